"""Each PoolNode serves Prometheus metrics on loopback; a scrape sees the pool's work."""

import time
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.pool.client import PoolClient


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_metrics_endpoint_follows_the_pool(client: PoolClient) -> None:
    [me] = [n for n in client.cache.nodes() if n.node_id == client.node_id]
    assert me.metrics.startswith("127.0.0.1:")  # published in the node record, on loopback
    node = (("node", client.node_id),)
    before = scrape(me.metrics)  # counters are cumulative over the module's pool: read as differences
    assert before[("kvpool_tier_capacity_bytes", (*node, ("tier", "dram")))] == 4 * 2**20

    keys = chunk_keys(CacheIdentity(model="m", kv_dtype="u8", layout="b", chunk_size=1), range(24))
    data = np.ones(256 * 1024, dtype=np.uint8)
    client.put_batch([(k, data) for k in keys])  # 6 MiB into 4 MiB of DRAM: migrations to NVMe
    client.get_batch(keys[:2])
    after = scrape(me.metrics)
    assert after[("kvpool_puts_total", node)] - before[("kvpool_puts_total", node)] == 24
    assert after[("kvpool_gets_total", node)] - before[("kvpool_gets_total", node)] >= 2
    moves = ("kvpool_tier_moves_total", tuple(sorted([*node, ("from_tier", "dram"), ("to_tier", "nvme")])))
    assert after[moves] - before.get(moves, 0) > 0
    assert after[("kvpool_tier_used_bytes", (*node, ("tier", "nvme")))] > 0
    assert after[("kvpool_etcd_errors_total", node)] == 0


def test_client_lookups_and_gets_reach_their_nodes_metrics(client: PoolClient) -> None:
    """Hits and misses of prefix lookups, bytes read by source and the get latency histogram: counted by the
    client, reported to its node, served there (close() reports what is left)."""
    [me] = [n for n in client.cache.nodes() if n.node_id == client.node_id]
    node = (("node", client.node_id),)
    before = scrape(me.metrics)  # counters are cumulative over the module's pool: read as differences
    keys = chunk_keys(CacheIdentity(model="hits", kv_dtype="u8", layout="b", chunk_size=1), range(8))
    client.put_batch([(k, np.full(4096, 7, dtype=np.uint8)) for k in keys[:5]])
    assert client.lookup_prefix(keys) == 5  # 5 hits, 3 misses
    client.get_batch(keys[:5])
    client._stats.report(force=True)  # what close() does; the periodic report is at most once a second

    hit = ("kvpool_lookup_chunks_total", (*node, ("result", "hit")))
    deadline = time.monotonic() + 10
    while (m := scrape(me.metrics)).get(hit, 0) - before.get(hit, 0) != 5 and time.monotonic() < deadline:
        time.sleep(0.1)  # the report is a call the client does not wait for

    def grew(name: str, *labels: tuple[str, str]) -> float:
        sample = (name, tuple(sorted((*node, *labels))))
        return m.get(sample, 0) - before.get(sample, 0)

    assert grew("kvpool_lookup_chunks_total", ("result", "hit")) == 5
    assert grew("kvpool_lookup_chunks_total", ("result", "miss")) == 3
    assert grew("kvpool_misses_total", ("cause", "never_stored")) == 1  # one lookup stopped short
    assert sum(grew("kvpool_client_get_bytes_total", ("source", s)) for s in ("local", "peer")) == 5 * 4096
    assert grew("kvpool_client_get_seconds_count") == 1
    assert grew("kvpool_client_get_seconds_bucket", ("le", "+Inf")) == 1
