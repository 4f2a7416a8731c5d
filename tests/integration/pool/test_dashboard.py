"""The Grafana dashboard (deploy/k8s/base/grafana-dashboard.json) asks only for metrics that a live pool node serves:
the module's real pool (tests/integration/pool/conftest.py) is given traffic (puts past DRAM's watermark, gets, a lookup that stops short), its node is
scraped, and every metric name in the dashboard's queries must be one the scrape shows — so the dashboard cannot
drift from pool/node/collector.py and pool/metrics.py."""

import json
import re
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.pool.client import PoolClient

DASHBOARD = Path(__file__).parents[3] / "deploy" / "k8s" / "base" / "grafana-dashboard.json"
METRIC = re.compile(r"\bkvpool_[a-z0-9_]+")
#: the samples a family of each type is exposed as (a counter family ``x`` is sampled as ``x_total``)
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}
#: what the dashboard must show (the issue's list): tiers and watermarks, hit rate, gets by source, moves, evictions,
#: misses by cause, engine tokens, tenants
SHOWN = {
    "kvpool_tier_used_bytes",
    "kvpool_dram_watermark_ratio",
    "kvpool_lookup_chunks_total",
    "kvpool_client_get_bytes_total",
    "kvpool_puts_total",
    "kvpool_tier_moves_total",
    "kvpool_evictions_total",
    "kvpool_misses_total",
    "kvpool_engine_tokens_total",
    "kvpool_tenant_used_bytes",
}


def queries(dashboard: dict[str, object]) -> list[str]:
    """Every PromQL query of the dashboard: its panels' targets and its template variables'."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            if isinstance(node.get("definition"), str):
                found.append(node["definition"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    return found


def exported(text: str) -> set[str]:
    """The sample names a Prometheus exposition holds, families without samples yet included."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def test_the_dashboard_asks_only_for_metrics_a_live_node_serves(client: PoolClient) -> None:
    keys = chunk_keys(CacheIdentity(model="dash", kv_dtype="u8", layout="b", chunk_size=1), range(24))
    client.put_batch([(k, np.ones(256 * 1024, dtype=np.uint8)) for k in keys[:20]])  # past DRAM's watermark
    client.get_batch(keys[:4])
    assert client.lookup_prefix(keys) == 20  # stops short: a miss with its cause
    client._stats.report(force=True)  # what close() does; the periodic report waits a second
    [me] = [n for n in client.cache.nodes() if n.node_id == client.node_id]
    with urllib.request.urlopen(f"http://{me.metrics}/metrics", timeout=10) as resp:
        served = exported(resp.read().decode())

    asked = queries(json.loads(DASHBOARD.read_text()))
    assert asked and all(METRIC.search(q) for q in asked), "every query names a kvpool metric"
    named = {name for q in asked for name in METRIC.findall(q)}
    assert named - served == set(), f"the dashboard asks for metrics no node serves: {sorted(named - served)}"
    assert named >= SHOWN, f"the dashboard leaves out {sorted(SHOWN - named)}"
