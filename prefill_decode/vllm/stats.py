"""kvpool's counts in vLLM's own stats: its ``/metrics`` and its periodic "KV Transfer metrics" log line.

vLLM asks each worker's connector for what it did since the last step (``get_kv_connector_stats``), adds the
workers' answers up (:meth:`KvPoolStats.aggregate`) and hands them to its loggers in the server process: the log line
(:meth:`KvPoolStats.reduce`) and Prometheus (:class:`KvPoolPromMetrics`, made by the connector class's
``build_prom_metrics``).  The counts are the ones the connector also reports to its pool node
(:class:`~kvpool.prefill_decode.connector_core.counts.EngineCounts`: the scheduler's lookups and misses travel to the
workers with each step's plan), so the engine's ``/metrics`` and the node's ``kvpool_engine_*`` agree; vLLM's
names carry its ``vllm:`` prefix and its own engine labels.
"""

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvpool.pool.metrics import FAULT_PREFIX, MISS_PREFIX, PREFETCH_MOVES, PREFETCH_RESULTS, TRANSFER_FAULTS

TOKEN_KINDS = ("lookup", "hit", "loaded", "saved")
DIRECTIONS = (("load", "loaded"), ("save", "saved"))


@dataclass
class KvPoolStats(KVConnectorStats):
    """Counts by the names :class:`EngineCounts` gives them, summed over workers and steps."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> "KvPoolStats":
        for name, n in other.data.items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            k: v if isinstance(v, int) else round(v, 4) for k, v in sorted(self.data.items())
        }
        for direction, past in DIRECTIONS:
            seconds = self.data.get(f"{direction}_seconds", 0)
            if seconds > 0:
                out[f"{direction}_GBps"] = round(self.data.get(f"{past}_bytes", 0) / seconds / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvPoolPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvpool_tokens{kind}``, ``vllm:kvpool_bytes{direction}``, ``vllm:kvpool_seconds{direction}``,
    ``vllm:kvpool_errors{direction}``, ``vllm:kvpool_misses{cause}``, ``vllm:kvpool_prefetches{result}``,
    ``vllm:kvpool_prefetched_objects{how}`` and ``vllm:kvpool_transfer_faults{kind}``: counters, per engine, as the
    pool node's ``kvpool_engine_*``, ``kvpool_misses_total`` and ``kvpool_transfer_faults_total`` count them (but
    for the engine alone, and kept when a pool node dies with its counts)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str, label: str) -> Any:
            return self._counter_cls(name=f"vllm:kvpool_{name}", documentation=doc, labelnames=[*labelnames, label])

        self.tokens = counter("tokens", "Prompt tokens kvpool's connector looked up, hit, loaded or saved", "kind")
        self.bytes = counter("bytes", "KV bytes kvpool's connector moved into or out of the paged cache", "direction")
        self.seconds = counter("seconds", "Seconds kvpool's connector spent loading or saving", "direction")
        self.errors = counter(
            "errors", "Chunks kvpool could not load (recomputed) or save batches it dropped", "direction"
        )
        self.misses = counter("misses", "Prompt chunks kvpool did not serve, by cause (kvpool explain)", "cause")
        self.prefetches = counter("prefetches", "Prefetches requests asked kvpool's connector for, by result", "result")
        self.prefetched = counter(
            "prefetched_objects", "Objects kvpool's prefetches brought into the node's DRAM, by how", "how"
        )
        self.faults = counter(
            "transfer_faults",
            "kvpool's one-sided transfers with other nodes that went wrong: a READ or WRITE that failed, one past its "
            "deadline (late), a WRITE to a node started again (restarted_peer)",
            "kind",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        data = transfer_stats_data

        def inc(metric: Any, label: str, n: float) -> None:
            if n > 0:
                metric.labels(*engine, label).inc(n)

        for kind in TOKEN_KINDS:
            inc(self.tokens, kind, data.get(f"{kind}_tokens", 0))
        for direction, past in DIRECTIONS:
            inc(self.bytes, direction, data.get(f"{past}_bytes", 0))
            inc(self.seconds, direction, data.get(f"{direction}_seconds", 0))
            inc(self.errors, direction, data.get(f"{direction}_errors", 0))
        for result in PREFETCH_RESULTS:
            inc(self.prefetches, result, data.get(f"prefetch_{result}", 0))
        for how in PREFETCH_MOVES:
            inc(self.prefetched, how, data.get(f"prefetch_{how}", 0))
        for kind in TRANSFER_FAULTS:
            inc(self.faults, kind, data.get(f"{FAULT_PREFIX}{kind}", 0))
        for name, n in data.items():
            if name.startswith(MISS_PREFIX):
                inc(self.misses, name.removeprefix(MISS_PREFIX), n)
