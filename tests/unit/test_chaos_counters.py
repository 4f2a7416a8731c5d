"""The chaos bench's "in the metrics" column: what a run moved of the pool nodes' fault counters."""

from kvpool.bench.serving.chaos_report import beyond, seen
from kvpool.bench.serving.faults import counted


def test_a_node_started_again_counts_from_zero_and_the_growth_is_summed_over_nodes() -> None:
    before = {
        ("a", 10): {"kvpool_transfer_faults_total{late}": 1.0, "kvpool_misses_total{evicted}": 4.0},
        ("b", 20): {"kvpool_misses_total{read_failed}": 2.0},
    }
    after = {
        ("a", 10): {"kvpool_transfer_faults_total{late}": 2.0, "kvpool_misses_total{evicted}": 4.0},
        ("b", 21): {"kvpool_misses_total{read_failed}": 3.0},  # b was started again: its 3 are all new
    }
    grew = counted(before, after)
    assert grew == {"kvpool_transfer_faults_total{late}": 1.0, "kvpool_misses_total{read_failed}": 3.0}
    assert seen(grew) == "miss read_failed 3, late 1"
    assert seen({"kvpool_engine_errors_total{save}": 2.0}) == "save errors 2"
    assert seen({}) == "none"


def test_a_row_shows_what_its_fault_moved_beyond_the_reference() -> None:
    reference = {"kvpool_misses_total{removed}": 6.0}
    run = {"kvpool_misses_total{removed}": 5.0, "kvpool_transfer_faults_total{late}": 1.0}
    assert seen(beyond(run, reference)) == "late 1"
