"""``bench/chaos.py`` at toy size, failing on any wrong token: a random Llama with SmolLM2's tokenizer on two vLLM
OpenAI servers over the session's engine pool (their own prefix caches off, as the bench runs them), ``kvpool route``
in front, four turns of one conversation of Mooncake's trace (the same 1024-token prompt, so every turn after the first
reads its chunks from the pool, turns 2 and 4 from the other engine's node) replayed without a fault, then once under
each fault the bench can inject on a pool it did not start, just before turn 2 (a PoolNode stopped past a READ's
deadline, one stopped and continued in turn, bytes flipped in its DRAM, every node's DRAM held by rooms never filled,
the PoolNode killed and started again, an engine killed; etcd is the session's, not the test's to restart).  Every answer must be the reference's, token for token, log-probabilities within 1e-3; a
request fails only where it went to the killed engine."""

import json
from pathlib import Path

import pytest

from kvpool.pool.config import PoolConfig


@pytest.mark.timeout(900)
def test_no_fault_makes_a_wrong_token(engine_pool: PoolConfig, toy_model: Path, tmp_path: Path) -> None:
    from kvpool.bench import chaos

    result = tmp_path / "chaos.json"
    kinds = ["node-kill", "peer-stall", "slow-peer", "byte-flip", "full-pool", "engine-kill"]
    args = ["--faults", ",".join(kinds), "--hold-s", "3", "--model", str(toy_model)]
    args += ["--sample", "1000", "--requests", "4", "--max-output", "4", "--json", str(result)]
    out = chaos.main(args, pool=engine_pool)

    rows = {r["fault"]: r for r in out["rows"]}
    assert set(rows) == {"none (reference)", *kinds}
    for kind, r in rows.items():
        assert r["wrong_tokens"] == r["logprobs_off"] == 0, (kind, r["mismatches"])
        assert not r.get("error"), (kind, r["error"])
        # a killed engine fails only what it had in flight (here at most the one request sent before the kill): the
        # router sends the rest, refused by it, to the live engine
        assert r["failed"] <= (1 if kind == "engine-kill" else 0), (kind, r["errors"])
    assert rows["none (reference)"]["pool_tokens"] > 0  # the second turn read the first's chunks
    assert rows["byte-flip"]["figures"]["caught"] > 0  # and failed their checksums where they were flipped
    assert rows["full-pool"]["figures"]["held"] > 0  # the rooms took the nodes' DRAM
    # the engines count their transfer faults themselves (a READ past a stalled node's deadline, one from a killed
    # node), so a killed node takes none of them with it
    moved = {name for r in rows.values() for name in r["metrics"]}
    assert any(name.startswith("vllm:kvpool_transfer_faults_total") for name in moved), moved
    assert json.loads(result.read_text())["rows"]
