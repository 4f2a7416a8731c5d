"""What clients see (lookups, gets, misses, an engine's counts), counted in their process and reported to the
``PoolNode`` of their Ray node, which serves them with its own metrics (:mod:`kvpool.pool.node.collector`)."""

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.pool.protocol import NodeHandle

#: upper bounds (seconds) of the client get latency histogram; one batched get is one observation
MISS_PREFIX = "miss_"  #: an engine's count named ``miss_<cause>`` is a short lookup or failed load: kvpool_misses_total
GET_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SOURCES = ("local", "peer", "remote_tier")  #: this node, another node, the remote tier
#: an engine's prefetches (``prefetch_<result>``): started, failed, late (its request stopped waiting for it first),
#: bad_hint (a request's hint was malformed: none started)
PREFETCH_RESULTS = ("started", "failed", "late", "bad_hint")
#: objects an engine's prefetches brought into its node's DRAM (``prefetch_<how>``): from the node's NVMe, or copied
#: from another node or the remote tier
PREFETCH_MOVES = ("promoted", "copied")
#: one-sided transfers with peers that went wrong (``pool/client/peers.py``): a READ or WRITE that failed, one that
#: passed its deadline and may still land (its transport set aside for good: ``late``), and a WRITE refused because
#: the peer was started again since its room was opened (``restarted_peer``)
TRANSFER_FAULTS = ("read_failed", "write_failed", "late", "restarted_peer")
FAULT_PREFIX = "fault_"  #: an engine's count named ``fault_<kind>``: its client's transfer faults (its own metrics)


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
    #: up / hit / loaded / saved, bytes loaded / saved, seconds spent loading / saving, load / save errors, prefetches
    engine: dict[str, float] = field(default_factory=dict)
    #: transfers with peers that went wrong, by :data:`TRANSFER_FAULTS`
    transfer_faults: dict[str, int] = field(default_factory=dict)

    def lookup(self, asked: int, held: int) -> None:
        self.lookup_hits += held
        self.lookup_misses += asked - held

    def miss(self, cause: str) -> None:
        self.misses[cause] = self.misses.get(cause, 0) + 1

    def transfer_fault(self, kind: str) -> None:
        self.transfer_faults[kind] = self.transfer_faults.get(kind, 0) + 1

    def get(self, seconds: float, by_source: dict[str, int]) -> None:
        for source, n in by_source.items():
            self.get_bytes[source] += n
        self.get_buckets[bisect.bisect_left(GET_SECONDS_BUCKETS, seconds)] += 1
        self.get_seconds += seconds

    def add_engine(self, counts: dict[str, float]) -> None:
        """An engine's counts (``PoolClient.record_engine`` checked them: names to numbers)."""
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
        for kind, count in other.transfer_faults.items():
            self.transfer_faults[kind] = self.transfer_faults.get(kind, 0) + count

    def __bool__(self) -> bool:
        counted = self.lookup_hits or self.lookup_misses or self.misses or sum(self.get_buckets) or self.engine
        return bool(counted or self.transfer_faults)

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
        faults = CounterMetricFamily(
            "kvpool_transfer_faults",
            "Transfers of clients on this node with peers that went wrong: a READ or WRITE that failed, one past its "
            "deadline that may still land (late: its transport set aside for good), a WRITE refused because the peer "
            "was started again since its room was opened (restarted_peer)",
            labels=["node", "kind"],
        )
        for kind in TRANSFER_FAULTS:
            faults.add_metric([node_id, kind], self.transfer_faults.get(kind, 0))
        yield from (lookups, misses, moved, latency, faults)
        yield from self._engine_metrics(node_id)

    def _engine_metrics(self, node_id: str) -> Iterator[Metric]:
        directions = (("load", "loaded"), ("save", "saved"))
        families = [  # (name, help, label, (label value, the engine count it shows) ...)
            (
                "kvpool_engine_tokens",
                "Prompt tokens an engine's KV connector on this node looked up, hit, loaded or saved",
                "kind",
                [(kind, f"{kind}_tokens") for kind in ("lookup", "hit", "loaded", "saved")],
            ),
            (
                "kvpool_engine_bytes",
                "KV bytes an engine's connector moved into or out of its paged cache",
                "direction",
                [(d, f"{past}_bytes") for d, past in directions],
            ),
            (
                "kvpool_engine_seconds",
                "Seconds an engine's connector spent loading or saving (its I/O thread)",
                "direction",
                [(d, f"{d}_seconds") for d, _ in directions],
            ),
            (
                "kvpool_engine_errors",
                "Chunks an engine's connector could not load (recomputed) or save batches it dropped",
                "direction",
                [(d, f"{d}_errors") for d, _ in directions],
            ),
            (
                "kvpool_engine_prefetches",
                "Prefetches requests asked an engine's connector on this node for, by result",
                "result",
                [(r, f"prefetch_{r}") for r in PREFETCH_RESULTS],
            ),
            (
                "kvpool_engine_prefetched_objects",
                "Objects an engine's prefetches brought into this node's DRAM: promoted from its NVMe, or copied",
                "how",
                [(how, f"prefetch_{how}") for how in PREFETCH_MOVES],
            ),
        ]
        for name, doc, label, values in families:
            family = CounterMetricFamily(name, doc, labels=["node", label])
            for value, count in values:
                family.add_metric([node_id, value], self.engine.get(count, 0))
            yield family


class StatsReporter:
    """A client's :class:`ClientStats`, handed to its node's ``PoolNode`` (``node()``: the node's actor at the time, or
    None when the client's Ray node has no pool node, so nobody to report to) at most about once every ``period_s``,
    without waiting."""

    def __init__(
        self, node: Callable[[], NodeHandle | None], period_s: float = 1.0, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.node, self.period_s, self.clock = node, period_s, clock
        self.seen, self._sent_at = ClientStats(), clock.monotonic()

    def report(self, force: bool = False) -> None:
        if not self.seen or (not force and self.clock.monotonic() - self._sent_at < self.period_s):
            return
        if (node := self.node()) is None:
            return
        node.report_clients(self.seen)
        self.seen, self._sent_at = ClientStats(), self.clock.monotonic()
