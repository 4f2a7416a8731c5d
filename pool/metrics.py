"""Prometheus metrics of a ``PoolNode``, read from its store at scrape time (nothing on the hot path).

Served over HTTP on ``PoolConfig.metrics_host:metrics_port`` (loopback and a free port by default) and
published in the node record, so ``kvpool status`` and a Prometheus file-SD job can find every node.
"""

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool import ray_auth
from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.core.types import Tier
from kvpool.errors import ConfigError
from kvpool.pool.protocol import NodeHandle
from kvpool.pool.tiers.gds import nvme_io_path

if TYPE_CHECKING:  # the node side's store; importing it here would run the node package from the client's side
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
    "reaped": ("kvpool_reservations_reaped", "Reservations never committed (writer died), space reclaimed", {}),
    "busy": ("kvpool_busy_refusals", "Moves and removes put off because a reader had the chunk pinned", {}),
    "corrupt": ("kvpool_corrupt_chunks", "Replicas dropped because their bytes failed the checksum", {}),
    "bytes_via_ray": ("kvpool_ray_bytes", "KV bytes moved as Ray call arguments/results, not one-sided", {}),
    "encoded": ("kvpool_codec_chunks", "Chunks re-stored with another codec on a move", {"direction": "encode"}),
    "decoded": ("kvpool_codec_chunks", "Chunks re-stored with another codec on a move", {"direction": "decode"}),
    "flushed": ("kvpool_remote_flushed_chunks", "NVMe chunks copied to the remote (S3) tier", {}),
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


#: upper bounds (seconds) of the client get latency histogram; one batched get is one observation
MISS_PREFIX = "miss_"  #: an engine's count named ``miss_<cause>`` is a short lookup or failed load: kvpool_misses_total
GET_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SOURCES = ("local", "peer", "remote_tier")  #: this node, another node, the S3 tier


@dataclass
class ClientStats:
    """What the clients on one node saw: prefix lookups (hits and misses, in chunks) and batched gets
    (bytes by source, latency).  Each ``PoolClient`` keeps one and reports it to its node's ``PoolNode``
    about once a second, which adds it up and serves it with its own metrics."""

    lookup_hits: int = 0
    lookup_misses: int = 0
    #: lookups that stopped short, by why their first missing chunk is missing, and reloads that fell back
    #: (``read_failed``): see :mod:`kvpool.metadata.misses`
    misses: dict[str, int] = field(default_factory=dict)
    get_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    get_buckets: list[int] = field(default_factory=lambda: [0] * (len(GET_SECONDS_BUCKETS) + 1))
    get_seconds: float = 0.0
    #: what an inference engine's connector on this node did (``prefill_decode/vllm_connector.py``): tokens looked
    #: up / hit / loaded / saved, bytes loaded / saved, seconds spent loading / saving, load / save errors
    engine: dict[str, float] = field(default_factory=dict)

    def lookup(self, asked: int, held: int) -> None:
        self.lookup_hits += held
        self.lookup_misses += asked - held

    def miss(self, cause: str) -> None:
        self.misses[cause] = self.misses.get(cause, 0) + 1

    def get(self, seconds: float, by_source: dict[str, int]) -> None:
        for source, n in by_source.items():
            self.get_bytes[source] += n
        self.get_buckets[bisect.bisect_left(GET_SECONDS_BUCKETS, seconds)] += 1
        self.get_seconds += seconds

    def add_engine(self, counts: dict[str, float]) -> None:
        if not isinstance(counts, dict) or not all(
            isinstance(k, str) and isinstance(n, (int, float)) and not isinstance(n, bool) for k, n in counts.items()
        ):
            raise ConfigError(f"counts must be a dict of names to numbers, got {counts!r:.80}")
        for name, n in counts.items():
            if name.startswith(MISS_PREFIX):
                cause = name.removeprefix(MISS_PREFIX)
                self.misses[cause] = self.misses.get(cause, 0) + int(n)
            else:
                self.engine[name] = self.engine.get(name, 0) + n

    def merge(self, other: "ClientStats") -> None:
        self.lookup_hits += other.lookup_hits
        self.lookup_misses += other.lookup_misses
        for cause, count in other.misses.items():
            self.misses[cause] = self.misses.get(cause, 0) + count
        for source in SOURCES:
            self.get_bytes[source] = self.get_bytes.get(source, 0) + other.get_bytes.get(source, 0)
        self.get_buckets = [a + b for a, b in zip(self.get_buckets, other.get_buckets, strict=True)]
        self.get_seconds += other.get_seconds
        for name, n in other.engine.items():
            self.engine[name] = self.engine.get(name, 0) + n

    def __bool__(self) -> bool:
        return bool(self.lookup_hits or self.lookup_misses or self.misses or sum(self.get_buckets) or self.engine)

    def collect(self, node_id: str) -> Iterator[Metric]:
        lookups = CounterMetricFamily(
            "kvpool_lookup_chunks",
            "Chunks asked for by prefix lookups of clients on this node",
            labels=["node", "result"],
        )
        lookups.add_metric([node_id, "hit"], self.lookup_hits)
        lookups.add_metric([node_id, "miss"], self.lookup_misses)
        misses = CounterMetricFamily(
            "kvpool_misses",
            "Lookups of clients on this node that stopped short, by why the first missing chunk is missing (evicted, "
            "removed, corrupt, node_left, never_stored), and reloads that fell back to recomputing (read_failed)",
            labels=["node", "cause"],
        )
        for cause, n in sorted(self.misses.items()):
            misses.add_metric([node_id, cause], n)
        moved = CounterMetricFamily(
            "kvpool_client_get_bytes",
            "Bytes read by clients on this node, by where the chunk was",
            labels=["node", "source"],
        )
        for source, n in self.get_bytes.items():
            moved.add_metric([node_id, source], n)
        latency = HistogramMetricFamily(
            "kvpool_client_get_seconds", "Latency of batched gets by clients on this node", labels=["node"]
        )
        cumulative, buckets = 0, []
        for bound, n in zip((*map(str, GET_SECONDS_BUCKETS), "+Inf"), self.get_buckets, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        latency.add_metric([node_id], buckets, sum_value=self.get_seconds)
        yield from (lookups, misses, moved, latency)
        yield from self._engine_metrics(node_id)

    def _engine_metrics(self, node_id: str) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "kvpool_engine_tokens",
            "Prompt tokens an engine's KV connector on this node looked up, hit, loaded or saved",
            labels=["node", "kind"],
        )
        for kind in ("lookup", "hit", "loaded", "saved"):
            tokens.add_metric([node_id, kind], self.engine.get(f"{kind}_tokens", 0))
        moved = CounterMetricFamily(
            "kvpool_engine_bytes",
            "KV bytes an engine's connector moved into or out of its paged cache",
            labels=["node", "direction"],
        )
        seconds = CounterMetricFamily(
            "kvpool_engine_seconds",
            "Seconds an engine's connector spent loading or saving (its I/O thread)",
            labels=["node", "direction"],
        )
        errors = CounterMetricFamily(
            "kvpool_engine_errors",
            "Chunks an engine's connector could not load (recomputed) or save batches it dropped",
            labels=["node", "direction"],
        )
        for direction, past in (("load", "loaded"), ("save", "saved")):
            moved.add_metric([node_id, direction], self.engine.get(f"{past}_bytes", 0))
            seconds.add_metric([node_id, direction], self.engine.get(f"{direction}_seconds", 0))
            errors.add_metric([node_id, direction], self.engine.get(f"{direction}_errors", 0))
        yield from (tokens, moved, seconds, errors)


class StatsReporter:
    """A client's :class:`ClientStats`, handed to its node's ``PoolNode`` (``node``; None: the client's Ray node has
    no pool node, so nobody to report to) at most about once every ``period_s``, without waiting."""

    def __init__(self, node: NodeHandle | None, period_s: float = 1.0, clock: Clock = SYSTEM_CLOCK) -> None:
        self.node, self.period_s, self.clock = node, period_s, clock
        self.seen, self._sent_at = ClientStats(), clock.monotonic()

    def report(self, force: bool = False) -> None:
        if self.node is None or not self.seen or (not force and self.clock.monotonic() - self._sent_at < self.period_s):
            return
        self.node.report_clients(self.seen)
        self.seen, self._sent_at = ClientStats(), self.clock.monotonic()


class StoreCollector(Collector):
    """A node's metrics: its store's, what its publisher counts (``published()``: ``etcd_errors``, requests that failed
    after retries; ``tombstones_unrecorded``, drops past the tombstone budget) and what its clients reported."""

    def __init__(
        self,
        node_id: str,
        store: "ChunkStore",
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
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server, f"{host}:{server.server_port}"
