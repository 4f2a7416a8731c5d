"""kvpool's counts as vLLM's connector stats: summed over workers and steps, reduced for vLLM's log line, and
counted in Prometheus under vLLM's engine labels (a registry of the test's own).  Needs vLLM (a skip where it is
optional and absent, as the engine tests)."""

from typing import Any

import pytest
from engine_needed import vllm_module

pytestmark = pytest.mark.slow  # imports vLLM (20-30 s on a busy box), once for the whole run


def test_worker_counts_add_up_and_reduce_to_vllms_log_line() -> None:
    stats = vllm_module("kvpool.prefill_decode.vllm.stats")
    a = stats.KvPoolStats(data={"loaded_tokens": 256, "loaded_bytes": 2e9, "load_seconds": 1.0, "miss_evicted": 1})
    b = stats.KvPoolStats(data={"loaded_tokens": 256, "loaded_bytes": 2e9, "load_seconds": 1.0})
    total = a.aggregate(b)
    assert total.data == {"loaded_tokens": 512, "loaded_bytes": 4e9, "load_seconds": 2.0, "miss_evicted": 1}
    assert total.reduce()["load_GBps"] == 2.0 and "save_GBps" not in total.reduce()
    total.reset()
    assert total.is_empty() and stats.KvPoolStats(data={"saved_tokens": 0}).is_empty()


def test_prometheus_counters_per_engine() -> None:
    stats = vllm_module("kvpool.prefill_decode.vllm.stats")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()

    def registered(kind: type) -> Any:
        return lambda *args, **kw: kind(*args, registry=registry, **kw)

    types = {Counter: registered(Counter), Gauge: registered(Gauge), Histogram: registered(Histogram)}
    config = type("VllmConfig", (), {"kv_transfer_config": None})()
    prom = stats.KvPoolPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"hit_tokens": 512, "loaded_tokens": 512, "loaded_bytes": 1024, "miss_node_left": 2}, 1)
    prom.observe({"loaded_tokens": 256, "prefetch_started": 1, "prefetch_promoted": 8, "fault_late": 1}, 1)
    text = generate_latest(registry).decode()
    assert 'vllm:kvpool_tokens_total{engine="1",kind="loaded",model_name="m"} 768.0' in text
    assert 'vllm:kvpool_misses_total{cause="node_left",engine="1",model_name="m"} 2.0' in text
    assert 'vllm:kvpool_bytes_total{direction="load",engine="1",model_name="m"} 1024.0' in text
    assert 'vllm:kvpool_prefetches_total{engine="1",model_name="m",result="started"} 1.0' in text
    assert 'vllm:kvpool_prefetched_objects_total{engine="1",how="promoted",model_name="m"} 8.0' in text
    assert 'vllm:kvpool_transfer_faults_total{engine="1",kind="late",model_name="m"} 1.0' in text
    assert 'engine="0"' not in text  # nothing counted for the other engine
