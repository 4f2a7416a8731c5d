"""``bench/serve.py`` end to end at toy size, so that the serving bench cannot rot: a random Llama with SmolLM2's
tokenizer (``vllm bench serve`` builds its prompts from text), one vLLM OpenAI server a layer (none, and kvpool on the
session's engine pool), ``kvpool route`` in front, six requests of one conversation of Mooncake's trace replayed by
``vllm bench serve`` round-robin and prefix-aware (following the engine's KV events), then the restart scenario.
What it checks is that every part ran and counted: every request answered, the router following the engine's events,
a fresh engine that took nothing from below without a layer and took the first half's prompts from the pool with
kvpool.  The figures are the benchmark's business, not this test's."""

import json
from pathlib import Path

import pytest

from kvpool.pool.config import PoolConfig


@pytest.mark.timeout(1200)
def test_the_serving_bench_runs_end_to_end(engine_pool: PoolConfig, toy_model: Path, tmp_path: Path) -> None:
    from kvpool.bench import serve

    result = tmp_path / "serve.json"
    args = ["--layers", "none,kvpool", "--routes", "round-robin,prefix-aware", "--engines", "1"]
    args += ["--model", str(toy_model)]
    args += ["--sample", "1000", "--requests", "6", "--max-input", "512", "--max-output", "4", "--speedup", "1000"]
    out = serve.main([*args, "--json", str(result)], pool=engine_pool)

    rows = {(r["layer"], r["route"]): r for r in out["rows"]}
    routes = ("round-robin", "prefix-aware", "restart")
    assert set(rows) == {(layer, route) for layer in ("none", "kvpool") for route in routes}
    for (layer, route), r in rows.items():
        assert "error" not in r, r
        assert (r["completed"], r["failed"]) == ((3, 0) if route == "restart" else (6, 0)), (layer, route)
        assert sum(r["tokens"].values()) > 0, (layer, route)
    assert rows["none", "restart"]["fresh_tokens"]["layer below"] == 0
    assert not any(rows["none", "round-robin"]["connector"].values())  # kvpool's connector's counts, where it runs
    assert rows["kvpool", "round-robin"]["connector"]["save_s"] > 0
    assert all(r["phases_s"]["prefill"] > 0 for (_, route), r in rows.items() if route == "round-robin")
    assert rows["kvpool", "restart"]["fresh_tokens"]["layer below"] > 0  # the first half's prompt, saved to the pool
    for layer in ("none", "kvpool"):  # prefix-aware follows the engine's own KV events (which blocks matched
        assert rows[layer, "prefix-aware"]["router"]["kv_events"] > 0  # depends on timing: the bench's business)
    assert json.loads(result.read_text())["rows"] and result.with_suffix(".png").stat().st_size > 0
