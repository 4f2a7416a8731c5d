"""The one place an engine's connector counts what it did, for its pool node's metrics."""

import threading
from collections.abc import Mapping
from typing import Protocol

from kvpool.metadata.lookup import Hit
from kvpool.metadata.misses import MissCause
from kvpool.pool.metrics import FAULT_PREFIX, MISS_PREFIX


class EngineSink(Protocol):
    """Where counts go: ``PoolClient.record_engine`` (to its node: ``kvpool_engine_*``, ``kvpool_misses_total``)."""

    def record_engine(self, counts: dict[str, float]) -> None: ...


class EngineCounts:
    """Counts by name (thread-safe): ``{lookup,hit,loaded,saved}_tokens``, ``{loaded,saved}_bytes``,
    ``{load,save}_seconds``, ``{load,save}_errors``, ``miss_<cause>`` (a short lookup or a failed load) and
    ``prefetch_<what>`` (:data:`~kvpool.pool.metrics.PREFETCH_RESULTS` and ``PREFETCH_MOVES``: the prefetches
    requests asked for, :mod:`.prefetch`) and ``fault_<kind>`` (its pool client's transfer faults,
    :meth:`transfer_faults`).

    ``totals`` keeps every count since the start.  Each of ``readers`` takes what it has not yet taken: ``"pool"``,
    what waits for :meth:`report` (a pool client is used by one thread: the engine reports from the thread that owns
    it) or is handed on with :meth:`take` (vLLM's scheduler has no client: its counts travel to the workers with each
    step's plan); ``"engine"``, the engine's own stats (vLLM's ``get_kv_connector_stats``)."""

    def __init__(self, readers: tuple[str, ...] = ("pool",)) -> None:
        self.totals: dict[str, float] = {}
        self._pending: dict[str, dict[str, float]] = {reader: {} for reader in readers}
        self._lock = threading.Lock()
        self._faults_seen: dict[str, int] = {}  #: the client's transfer faults at the last :meth:`transfer_faults`

    def add(self, **counts: float) -> None:
        self._add(counts, self._pending)

    def _add(self, counts: Mapping[str, float], readers: Mapping[str, dict[str, float]]) -> None:
        with self._lock:
            for name, n in counts.items():
                self.totals[name] = self.totals.get(name, 0) + n
                for pending in readers.values():
                    pending[name] = pending.get(name, 0) + n

    def transfer_faults(self, totals: Mapping[str, int]) -> None:
        """The pool client's transfer faults so far (``PoolClient.transfer_faults``): what grew since the last call
        is counted as ``fault_<kind>``, for every reader but ``"pool"`` (the client reports them to its node itself,
        where they are lost if that node dies; an engine's own metrics keep them).  A client made anew counts from 0."""
        grew = {}
        for kind, n in totals.items():
            last = self._faults_seen.get(kind, 0)
            if n != last:
                grew[f"{FAULT_PREFIX}{kind}"] = n - last if n > last else n
        self._faults_seen = dict(totals)
        if grew:
            self._add(grew, {r: p for r, p in self._pending.items() if r != "pool"})

    def lookup(self, hit: Hit, prompt_tokens: int, chunk_size: int) -> None:
        """A prefix lookup for a prompt of ``prompt_tokens``: those are looked up, and those of the chunks held are
        hit, but for the last prompt token (every engine computes it, for its logits)."""
        self.add(lookup_tokens=prompt_tokens, hit_tokens=max(0, min(hit.held * chunk_size, prompt_tokens - 1)))
        if hit.cause is not None:
            self.miss(hit.cause)

    def miss(self, cause: MissCause, n: int = 1) -> None:
        self.add(**{f"{MISS_PREFIX}{cause.value}": n})

    def take(self, reader: str = "pool") -> dict[str, float]:
        """What ``reader`` has not taken yet, now counted as taken."""
        with self._lock:
            pending, self._pending[reader] = self._pending[reader], {}
        return pending

    def report(self, sink: EngineSink) -> None:
        pending = self.take()
        if pending:
            sink.record_engine(pending)
