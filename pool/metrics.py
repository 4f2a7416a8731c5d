"""Prometheus metrics of a ``PoolNode``, read from its store at scrape time (nothing on the hot path).

Served over HTTP on ``PoolConfig.metrics_host:metrics_port`` (loopback and a free port by default) and
published in the node record, so ``kvpool status`` and a Prometheus file-SD job can find every node.
"""

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.pool.store import ChunkStore

#: store counter → (metric name, help, labels): migrations and promotions are moves between tiers
_COUNTERS = {
    "puts": ("kvpool_puts", "Chunks stored by this node", {}),
    "gets": ("kvpool_gets", "Chunk reads served by this node (pinned, or same-node optimistic reads reported)", {}),
    "migrations": ("kvpool_tier_moves", "Chunks moved between tiers", {"from_tier": "dram", "to_tier": "nvme"}),
    "promotions": ("kvpool_tier_moves", "Chunks moved between tiers", {"from_tier": "nvme", "to_tier": "dram"}),
    "drops": ("kvpool_evictions", "Chunks dropped to make room", {}),
    "corrupt": ("kvpool_corrupt_chunks", "Replicas dropped because their bytes failed the checksum", {}),
    "bytes_via_ray": ("kvpool_ray_bytes", "KV bytes moved as Ray call arguments/results, not one-sided", {}),
}


class StoreCollector(Collector):
    def __init__(self, node_id: str, store: ChunkStore, etcd_errors: Callable[[], int]) -> None:
        self.node_id, self.store, self.etcd_errors = node_id, store, etcd_errors

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            "kvpool_tier_used_bytes", "Bytes allocated in a tier's segment", labels=["node", "tier"]
        )
        cap = GaugeMetricFamily("kvpool_tier_capacity_bytes", "Capacity of a tier's segment", labels=["node", "tier"])
        chunks = GaugeMetricFamily("kvpool_tier_chunks", "Chunks held in a tier", labels=["node", "tier"])
        frag = GaugeMetricFamily("kvpool_tier_fragmentation_ratio", "1 - largest free extent / free bytes", labels=["node", "tier"])  # fmt: skip
        for tier, alloc in self.store.allocators.items():
            where = [self.node_id, tier.value]
            used.add_metric(where, alloc.used)
            cap.add_metric(where, alloc.capacity)
            chunks.add_metric(where, self.store.policy.count(tier))
            frag.add_metric(where, alloc.stats().fragmentation)
        marks = GaugeMetricFamily(
            "kvpool_dram_watermark_ratio", "DRAM migrates to NVMe above high, down to low", labels=["node", "level"]
        )
        marks.add_metric([self.node_id, "high"], self.store.watermarks.high)
        marks.add_metric([self.node_id, "low"], self.store.watermarks.low)
        yield from (used, cap, chunks, frag, marks)
        families: dict[str, CounterMetricFamily] = {}
        for key, (name, doc, labels) in _COUNTERS.items():
            fam = families.setdefault(name, CounterMetricFamily(name, doc, labels=["node", *labels]))
            fam.add_metric([self.node_id, *labels.values()], self.store.counters[key])
        errors = CounterMetricFamily("kvpool_etcd_errors", "etcd requests that failed after retries", labels=["node"])
        errors.add_metric([self.node_id], self.etcd_errors())
        yield from (*families.values(), errors)


def serve_metrics(collector: StoreCollector, host: str, port: int) -> tuple[Any, str]:
    """Serve ``collector`` on ``host:port`` (0: a free port); returns the server and its ``host:port``."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server, f"{host}:{server.server_port}"
