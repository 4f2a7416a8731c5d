"""What clients report to their node for its metrics: miss causes, from our connector and from an engine's."""

from prometheus_client.core import Metric

from kvpool.pool.metrics import MISS_PREFIX, ClientStats


def _samples(stats: ClientStats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    families: list[Metric] = list(stats.collect("n1"))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_miss_causes_add_up_and_are_served() -> None:
    a, b = ClientStats(), ClientStats()
    a.miss("evicted")
    a.miss("evicted")
    b.add_engine({f"{MISS_PREFIX}read_failed": 3, "lookup_tokens": 100})  # an engine's counts: misses apart
    a.merge(b)
    assert a.misses == {"evicted": 2, "read_failed": 3} and a.engine == {"lookup_tokens": 100}
    got = _samples(a)
    assert got[("kvpool_misses_total", (("cause", "evicted"), ("node", "n1")))] == 2
    assert got[("kvpool_misses_total", (("cause", "read_failed"), ("node", "n1")))] == 3
    assert bool(ClientStats()) is False and bool(b) is True


def test_an_engines_prefetches_are_served_by_result_and_objects_by_how() -> None:
    stats = ClientStats()
    stats.add_engine({"prefetch_started": 2, "prefetch_late": 1, "prefetch_promoted": 16, "prefetch_copied": 4})
    got = _samples(stats)
    assert got[("kvpool_engine_prefetches_total", (("node", "n1"), ("result", "started")))] == 2
    assert got[("kvpool_engine_prefetches_total", (("node", "n1"), ("result", "late")))] == 1
    assert got[("kvpool_engine_prefetches_total", (("node", "n1"), ("result", "failed")))] == 0
    assert got[("kvpool_engine_prefetched_objects_total", (("how", "promoted"), ("node", "n1")))] == 16
    assert got[("kvpool_engine_prefetched_objects_total", (("how", "copied"), ("node", "n1")))] == 4


def test_transfer_faults_add_up_and_every_kind_is_served() -> None:
    a, b = ClientStats(), ClientStats()
    a.transfer_fault("late")
    b.transfer_fault("late")
    b.transfer_fault("restarted_peer")
    assert bool(b) is True
    a.merge(b)
    got = _samples(a)
    assert got[("kvpool_transfer_faults_total", (("kind", "late"), ("node", "n1")))] == 2
    assert got[("kvpool_transfer_faults_total", (("kind", "restarted_peer"), ("node", "n1")))] == 1
    assert got[("kvpool_transfer_faults_total", (("kind", "read_failed"), ("node", "n1")))] == 0  # shown before any
