"""Prometheus metrics of a ``PoolNode``, read from its store at scrape time (nothing on the hot path), with what its
clients reported (:class:`~kvpool.pool.metrics.ClientStats`).

Served over HTTP on ``PoolConfig.metrics_host:metrics_port`` (loopback and a free port by default) and
published in the node record, so ``kvpool status`` and a Prometheus file-SD job can find every node.
"""

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool import ray_auth
from kvpool.core.types import Tier
from kvpool.errors import SetupError
from kvpool.pool.gds import nvme_io_path
from kvpool.pool.metrics import ClientStats
from kvpool.pool.node.store import ChunkStore

#: store counter → (metric name, help, labels): migrations and promotions are moves between tiers
_COUNTERS = {
    "puts": ("kvpool_puts", "Chunks stored by this node", {}),
    "gets": ("kvpool_gets", "Chunk reads served by this node (pinned, or same-node optimistic reads reported)", {}),
    "misses": ("kvpool_get_misses", "Reads of chunks this node no longer held (a placement gone stale)", {}),
    "migrations": ("kvpool_tier_moves", "Chunks moved between tiers", {"from_tier": "dram", "to_tier": "nvme"}),
    "promotions": ("kvpool_tier_moves", "Chunks moved between tiers", {"from_tier": "nvme", "to_tier": "dram"}),
    "drops": ("kvpool_evictions", "Chunks dropped to make room", {"reason": "room"}),
    "quota_drops": ("kvpool_evictions", "Chunks dropped to make room", {"reason": "tenant_quota"}),
    "reaped": ("kvpool_reservations_reaped", "Writers' rooms never filled (writer died), space reclaimed", {}),
    "busy": ("kvpool_busy_refusals", "Moves and removes put off because a reader had the chunk pinned", {}),
    "corrupt": ("kvpool_corrupt_chunks", "Replicas dropped because their bytes failed the checksum", {}),
    "bytes_via_ray": ("kvpool_ray_bytes", "KV bytes moved as Ray call arguments/results, not one-sided", {}),
    "encoded": ("kvpool_codec_chunks", "Chunks re-stored with another codec on a move", {"direction": "encode"}),
    "decoded": ("kvpool_codec_chunks", "Chunks re-stored with another codec on a move", {"direction": "decode"}),
    "flushed": ("kvpool_remote_flushed_chunks", "NVMe chunks copied to the remote tier", {}),
    "flushed_bytes": ("kvpool_remote_flushed_bytes", "Bytes uploaded to the remote tier (after its codec)", {}),
    "remote_errors": ("kvpool_remote_errors", "Flush turns or checks the remote tier refused (endpoint, 403)", {}),
    "recovered": (
        "kvpool_restart_chunks",
        "NVMe chunks found at start, left by this node's last run",
        {"outcome": "adopted"},
    ),
    "recovery_dropped": (
        "kvpool_restart_chunks",
        "NVMe chunks found at start, left by this node's last run",
        {"outcome": "dropped"},
    ),
}


class StoreCollector(Collector):
    """A node's metrics: its store's, what its publisher counts (``published()``: ``etcd_errors``, requests that failed
    after retries; ``tombstones_unrecorded``, drops past the tombstone budget) and what its clients reported."""

    def __init__(
        self,
        node_id: str,
        store: ChunkStore,
        published: Callable[[], dict[str, int]],
        clients: ClientStats | None = None,
    ) -> None:
        self.node_id, self.store, self.published = node_id, store, published
        self.clients = clients if clients is not None else ClientStats()

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            "kvpool_tier_used_bytes", "Bytes allocated in a tier's segment", labels=["node", "tier"]
        )
        cap = GaugeMetricFamily("kvpool_tier_capacity_bytes", "Capacity of a tier's segment", labels=["node", "tier"])
        chunks = GaugeMetricFamily("kvpool_tier_chunks", "Chunks held in a tier", labels=["node", "tier"])
        frag = GaugeMetricFamily(
            "kvpool_tier_fragmentation_ratio", "1 - largest free extent / free bytes", labels=["node", "tier"]
        )
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
        yield from (used, cap, chunks, frag, marks, *self._tenants())
        families: dict[str, CounterMetricFamily] = {}
        for key, (name, doc, labels) in _COUNTERS.items():
            fam = families.setdefault(name, CounterMetricFamily(name, doc, labels=["node", *labels]))
            fam.add_metric([self.node_id, *labels.values()], self.store.counters.get(key, 0))
        published = self.published()
        errors = CounterMetricFamily("kvpool_etcd_errors", "etcd requests that failed after retries", labels=["node"])
        errors.add_metric([self.node_id], published.get("etcd_errors", 0))
        stones = CounterMetricFamily(
            "kvpool_tombstones_unrecorded",
            "Chunks dropped past this node's tombstone budget: why they went is not kept",
            labels=["node"],
        )
        stones.add_metric([self.node_id], published.get("tombstones_unrecorded", 0))
        io = GaugeMetricFamily(
            "kvpool_nvme_io_path", "How NVMe reaches GPU memory (1 on the path in use)", labels=["node", "path"]
        )
        io.add_metric([self.node_id, nvme_io_path().name], 1)
        auth = GaugeMetricFamily(
            "kvpool_ray_auth_mode",
            "Ray authentication of this node's Ray (1 on the mode in use)",
            labels=["node", "mode"],
        )
        auth.add_metric([self.node_id, ray_auth.current_mode()], 1)
        yield from (*families.values(), errors, stones, io, auth)
        yield from self.clients.collect(self.node_id)

    def _tenants(self) -> Iterator[Metric]:
        """Bytes each tenant holds per tier, and its quota (pool/tenants.py); chunks put by no tenant: tenant=""."""
        used = GaugeMetricFamily(
            "kvpool_tenant_used_bytes", "Bytes a tenant's chunks take in a tier", labels=["node", "tenant", "tier"]
        )
        quota = GaugeMetricFamily(
            "kvpool_tenant_quota_bytes",
            "Bytes a tenant may hold in a tier (0: no quota)",
            labels=["node", "tenant", "tier"],
        )
        for tenant, tiers in self.store.policy.used().items():
            for tier, n in tiers.items():
                used.add_metric([self.node_id, tenant, tier.value], n)
        for tenant, limits in self.store.quotas.items():
            for tier, n in zip((Tier.DRAM, Tier.NVME), limits, strict=True):
                quota.add_metric([self.node_id, tenant, tier.value], n)
        yield from (used, quota)


def serve_metrics(collector: StoreCollector, host: str, port: int) -> tuple[Any, str]:
    """Serve ``collector`` on ``host:port`` (0: a free port); returns the server and its ``host:port``."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise SetupError(
            f"the node's metrics cannot be served on {host}:{port} ({exc.strerror}): give another metrics_port "
            "(kvpool join --metrics-port), 0 for a free one, or a metrics_host of this machine"
        ) from None
    return server, f"{host}:{server.server_port}"
