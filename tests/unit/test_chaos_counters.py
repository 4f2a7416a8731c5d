"""The chaos bench's "in the metrics" column: what a run moved of the engines' kvpool fault counters."""

import time
from typing import Any

from kvpool.bench.serving import faults
from kvpool.bench.serving.chaos_report import beyond, seen
from kvpool.bench.serving.faults import counted
from kvpool.bench.serving.harness import faults_in


def test_an_engine_new_to_the_run_counts_from_zero_and_the_growth_is_summed_over_engines() -> None:
    late, read_failed = "vllm:kvpool_transfer_faults_total{late}", "vllm:kvpool_misses_total{read_failed}"
    before = {"http://a": {late: 1.0, "vllm:kvpool_misses_total{evicted}": 4.0}}
    after = {
        "http://a": {late: 2.0, "vllm:kvpool_misses_total{evicted}": 4.0},
        "http://b": {read_failed: 3.0},  # not counted before: its 3 are all new
    }
    grew = counted(before, after)
    assert grew == {late: 1.0, read_failed: 3.0}
    assert seen(grew) == "miss read_failed 3, late 1"
    assert seen({"vllm:kvpool_errors_total{save}": 2.0}) == "save errors 2"
    assert seen({}) == "none"


def test_a_row_shows_what_its_fault_moved_beyond_the_reference() -> None:
    reference = {"vllm:kvpool_misses_total{removed}": 6.0}
    run = {"vllm:kvpool_misses_total{removed}": 5.0, "vllm:kvpool_transfer_faults_total{late}": 1.0}
    assert seen(beyond(run, reference)) == "late 1"


def test_an_engines_fault_counters_are_read_by_their_label_whatever_the_others() -> None:
    text = "\n".join(
        [
            "# HELP vllm:kvpool_transfer_faults_total kvpool's one-sided transfers ...",
            'vllm:kvpool_transfer_faults_total{engine="0",kind="late",model_name="m"} 1.0',
            'vllm:kvpool_misses_total{cause="node_left",engine="0",model_name="m"} 2.0',
            'vllm:kvpool_misses_total{cause="node_left",engine="1",model_name="m"} 3.0',
            'vllm:kvpool_errors_total{direction="load",engine="0",model_name="m"} 4.0',
            'vllm:kvpool_tokens_total{engine="0",kind="loaded",model_name="m"} 512.0',
            'vllm:mooncake_store_operation_failed_keys_total{engine="0",model_name="m",operation="get",status="error"} 15.0',
        ]
    )
    assert faults_in(text) == {
        "vllm:kvpool_transfer_faults_total{late}": 1.0,
        "vllm:kvpool_misses_total{node_left}": 5.0,
        "vllm:kvpool_errors_total{load}": 4.0,
        "vllm:mooncake_store_operation_failed_keys_total{get}": 15.0,
    }
    assert seen({"vllm:mooncake_store_operation_failed_keys_total{get}": 15.0}) == "get keys failed 15"


def test_a_mixed_series_whose_faults_all_fail_waits_out_each_turn() -> None:
    """A fault that cannot be made (a stall shorter than a READ's deadline) is its turn's error; with no gap between
    turns, the series still waits each turn out instead of spinning."""
    made: list[str] = []

    def counting(kind: str, hold_s: float) -> Any:
        made.append(kind)
        return faults.fault(kind, None, hold_s)  # type: ignore[arg-type]

    mixed = faults.Mixed(make=counting, hold_s=60, kinds=("peer-stall",), each_s=0.5, gap_s=0)
    mixed.inject()
    time.sleep(0.3)
    mixed.end()
    assert 1 <= len(made) <= 3  # an upper bound only: a busy machine makes fewer turns, never more
    assert "peer-stall failed: ConfigError: a stall must outlast" in mixed.outcome()
