"""KvPoolConnector on models beyond one full-attention group: MLA (DeepSeek-V2), a sliding-window hybrid (Gemma3)
and a Mamba-2 hybrid (Falcon-H1), each a tiny random-weight model (prefill_decode/reference/tiny_models.py), on real vLLM CPU engines."""

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from engines import CHUNK, P, engine, extra_config, prompt, reloaded

from kvpool.core.keys import CacheIdentity, chunk_keys, layer_key
from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig
from kvpool.pool.protocol import actor_name
from kvpool.pool.segment import DramSegment
from kvpool.prefill_decode.reference.tiny_models import FAMILIES, save_tiny
from kvpool.prefill_decode.vllm.config import ConnectorConfig
from kvpool.prefill_decode.vllm.cpu_backends import MLA_BACKENDS, MlaBackend, unavailable
from kvpool.prefill_decode.vllm.engine import EngineProcess
from kvpool.prefill_decode.vllm.groups import KvGroups, PoolLayer
from kvpool.prefill_decode.vllm.scheduler import KvPoolMetadata, Transfer
from kvpool.prefill_decode.vllm.worker import WorkerSide

ONE = P[:CHUNK] + prompt(4, 200)  #: shares P's first chunk only

#: the engine tests start one or two vLLM engines each (20-60 s each on 2 busy cores)
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-models")
    return {name: str(save_tiny(name, root)) for name in FAMILIES}


def test_worker_side_moves_each_group_s_blocks_and_one_rank_writes_replicated_kv(engine_pool: PoolConfig) -> None:
    """Two groups in one shared buffer (as vLLM's hybrid manager lays them out): a full layer saves every block of
    a chunk, a sliding-window layer (window 64 = 2 of a chunk's 4 blocks) the chunk's last 2; a whole-request load
    writes them into other blocks, never into vLLM's null block, and reports the request ended.  A rank whose KV
    another rank writes (MLA) saves nothing and reports its saves done."""
    config = ConnectorConfig.from_extra(extra_config(engine_pool, chunk_size=128))
    identity = CacheIdentity(model="hybrid-worker-test", kv_dtype="float32", layout="vllm-test:groups", chunk_size=128)
    groups = KvGroups((PoolLayer("full", 0, 0), PoolLayer("window", 1, 1, window=64)), 32, 128)
    buffer = torch.randn(24, 2, 32, 128)
    tokens = list(range(256))  # 2 chunks of 4 blocks
    full, window = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    meta = KvPoolMetadata(saves=[Transfer("r1", tokens, 0, 2, [full, window])])
    saver, other_rank = WorkerSide(config, identity, groups, 24), WorkerSide(config, identity, groups, 24, writes=False)
    for side in (saver, other_rank):
        side.register({"full": buffer, "window": buffer})
        side.start_step(meta)
        for name in ("full", "window"):
            side.layer_done(name, meta)
        side.end_step(meta)
    assert other_rank.finished({"r1"}) == {"r1"} and "saved_tokens" not in other_rank.counts.totals
    deadline = time.monotonic() + 60
    while saver.finished({"r1"}) != {"r1"}:
        assert time.monotonic() < deadline, "saves of r1 never reported done"
        time.sleep(0.05)
    assert saver.counts.totals["saved_bytes"] == (8 + 2 * 2) * 2 * 32 * 128 * 4

    dst = torch.zeros_like(buffer)
    loader = WorkerSide(config, identity, groups, 24)
    loader.register({"full": dst, "window": dst})
    # vLLM pads the window's group with its null block left of the window of the hit's end
    load = Transfer("r2", tokens, 0, 2, [[17, 18, 19, 20, 21, 22, 23, 1], [0, 0, 0, 0, 0, 0, 2, 3]], whole_request=True)
    loader.start_step(KvPoolMetadata(loads=[load]))
    deadline = time.monotonic() + 60
    while not (ended := loader.loaded())[0]:
        assert time.monotonic() < deadline, "the load of r2 never ended"
        time.sleep(0.05)
    assert ended == ({"r2"}, set())
    assert torch.equal(dst[[17, 18, 19, 20, 21, 22, 23, 1]], buffer[full])
    assert torch.equal(dst[[2, 3]], buffer[[15, 16]]) and not dst[0].any()
    never = Transfer("r3", list(range(1000, 1256)), 0, 2, load.block_ids, whole_request=True)  # nothing saved
    loader.start_step(KvPoolMetadata(loads=[never]))
    while not (ended := loader.loaded())[0]:
        assert time.monotonic() < deadline, "the load of r3 never ended"
        time.sleep(0.05)
    assert ended == ({"r3"}, {"r3"})  # vLLM computes r3 from its start
    for side in (saver, other_rank, loader):
        side.close()


def from_the_pool(
    pool: PoolConfig,
    model: str,
    name: str,
    logs: Path,
    then: Callable[[EngineProcess], None] | None = None,
    settings: dict[str, Any] | None = None,
) -> tuple[tuple[dict[str, Any], dict[str, Any]], dict[str, Any], dict[str, float], dict[str, Any]]:
    """The answers of an engine with the connector that computes and saves P (the pool empty: the recomputed
    answer) and then answers ONE (which shares P's first chunk only; the engine's own prefix cache serves that
    chunk); its answer to P with its own prefix cache emptied, from the pool, and what the connector counted for it;
    its connector state (before ``then(engine)``, if given, runs).  ``settings``: the engine's beyond its model and
    connector.  (An engine without the connector answers as it does: test_vllm_connector.py checks that against
    transformers, the Mamba hybrid below here; a fresh engine in another process takes its prompt from the pool as
    this one does: test_vllm_connector.py.)"""
    settings = {"model": model, "connector": extra_config(pool, model_id=name), **(settings or {})}
    with engine(settings, logs / f"{name}.log") as e:
        [computed] = e.generate([P])
        [other] = e.generate([ONE])
        loaded, moved = reloaded(e, P, 2 * CHUNK)
        state = e.ask(connector=True)
        if then is not None:
            then(e)
    return (computed, other), loaded, moved, state


def beside_its_own_cache(
    pool: PoolConfig, model: str, name: str, logs: Path, settings: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, float]], dict[str, Any]]:
    """An engine that keeps vLLM's own prefix cache on answers T (two chunks and 20 tokens: its own cache holds the
    same 512 tokens as the pool) cold (``cold``, saving both chunks), again from its own cache (``own``), from the
    pool alone, its own cache emptied (``pool``), and from both (``both``): its own cache holding the first chunk
    (left there by ONE, which took it from the pool), the pool's second chunk loaded from token 256 on.  Its answers,
    what the connector counted for ``pool`` and ``both``, and its connector state.  ``own``, ``pool`` and ``both``
    compute the same 20 tokens over the same 512 cached ones: the same answer, whatever the dtype rounds."""
    t = P[: 2 * CHUNK + 20]
    with engine(
        {"model": model, "connector": extra_config(pool, model_id=name), **settings}, logs / f"{name}.log"
    ) as e:
        [cold] = e.generate([t])
        [own] = e.generate([t])
        from_pool, moved = reloaded(e, t, 2 * CHUNK)
        e.generate([ONE], reset=True)
        before = e.ask(connector=True)["totals"]
        [both] = e.generate([t])
        after = e.ask(connector=True)["totals"]
        state = e.ask(connector=True)
    answers = {"cold": cold, "own": own, "pool": from_pool, "both": both}
    return answers, {"pool": moved, "both": {k: v - before.get(k, 0) for k, v in after.items()}}, state


#: vLLM's CPU MLA backends; one this host cannot run is skipped, saying why
MLA = [
    pytest.param(b, id=b.name, marks=pytest.mark.skipif(bool(unavailable(b)), reason=unavailable(b)))
    for b in MLA_BACKENDS
]


@pytest.mark.parametrize("backend", MLA)
def test_mla_stores_one_copy_for_every_rank_and_takes_its_prompt_from_the_pool(
    backend: MlaBackend, engine_pool: PoolConfig, models: dict[str, str], tmp_path: Path
) -> None:
    """DeepSeek-V2's latent KV (``[blocks, block size, 576]``) is keyed with no TP rank: one copy for all.  CPU_MLA
    (float32, block 16): vLLM turns its own prefix cache and chunked prefill off, and still loads the connector's
    tokens; the answer from the pool is the one computed.  AMX_MLA (bf16, block 32): vLLM keeps both on, so the pool
    serves a prompt alone or after vLLM's own hit, loading from mid-prompt; each answer is the one vLLM's own prefix
    cache gives (bf16 rounds a 532-token prefill otherwise than 20 tokens over a cached 512)."""
    model = models["deepseek-v2-mla"]
    if not backend.prefix_caching:
        (computed, _), loaded, moved, state = from_the_pool(
            engine_pool, model, "dsv2", tmp_path, None, backend.settings()
        )
        assert computed["cached"] == 0
        assert loaded["cached"] == 2 * CHUNK and loaded["tokens"] == computed["tokens"]
        assert moved["loaded_tokens"] == 2 * CHUNK and moved["load_errors"] == 0
    else:
        answers, moved, state = beside_its_own_cache(engine_pool, model, "dsv2", tmp_path, backend.settings())
        assert answers["cold"]["cached"] == 0 and all(
            answers[k]["cached"] == 2 * CHUNK for k in ("own", "pool", "both")
        )
        assert answers["pool"]["tokens"] == answers["own"]["tokens"] == answers["both"]["tokens"]
        assert moved["pool"]["loaded_tokens"] == 2 * CHUNK and moved["both"]["loaded_tokens"] == CHUNK
        assert moved["pool"]["load_errors"] == moved["both"]["load_errors"] == 0
    identity = state["identity"]
    assert (identity["tp_size"], identity["tp_rank"], identity["kv_dtype"]) == (1, 0, backend.dtype)
    assert f":{backend.name}:" in identity["layout"]
    assert f"MLAAttentionSpec:kv_heads=1:head_size=576:block={backend.block_size}" in identity["layout"]


def test_a_sliding_window_hybrid_takes_its_prompt_from_the_pool(
    engine_pool: PoolConfig, models: dict[str, str], tmp_path: Path
) -> None:
    """Gemma3 with vLLM's hybrid KV manager on (the connector supports it): 4 groups sharing one buffer; the
    sliding-window layers store and load only the blocks inside the window of each chunk's end.  A chunk whose
    bytes fail their checksum fails the whole-request load: vLLM computes the request from its start, same answer."""
    recomputed: list[dict[str, Any]] = []

    def corrupt_then_ask(b: EngineProcess) -> None:
        # a hit ending at P's first chunk needs that chunk's windowed blocks, saved although the window of P's end
        # had left them
        recomputed.extend(b.generate([ONE], reset=True))
        identity = CacheIdentity(**b.ask(connector=True)["identity"])
        with PoolClient(engine_pool) as client:
            victim = layer_key(chunk_keys(identity, P)[1], 0)
            assert client.cache.wait_until(lambda c: bool(c.replicas(victim)), 30)  # the test's watch is in
            [p] = client.cache.replicas(victim)
            info = ray.get(ray.get_actor(actor_name(p.node), namespace=engine_pool.namespace).info.remote())
            with DramSegment.attach(info.dram_path, info.dram_capacity) as seg:
                seg.write(p.offset + 100, bytes([seg.view(p.offset + 100, 1)[0] ^ 0xFF]))
        recomputed.extend(b.generate([P], reset=True))
        recomputed.append(b.ask(connector=True)["totals"])

    model = models["gemma3-sliding"]
    (want, want_o), loaded, moved, state = from_the_pool(engine_pool, model, "gemma3", tmp_path, corrupt_then_ask)
    assert want["cached"] == 0
    assert loaded["cached"] == 2 * CHUNK and loaded["tokens"] == want["tokens"]
    assert moved["loaded_tokens"] == 2 * CHUNK and moved["load_errors"] == 0
    # the full layer's 2 chunks of 8 blocks, each windowed layer's last chunk's last 4 blocks ([2, 32, 128] fp32)
    assert moved["loaded_bytes"] == (2 * 8 + 3 * 4) * 2 * 32 * 128 * 4
    assert "SlidingWindowSpec" in state["identity"]["layout"] and "window=128" in state["identity"]["layout"]
    partial, again, totals = recomputed
    assert partial["cached"] == CHUNK and partial["tokens"] == want_o["tokens"]
    assert again["tokens"] == want["tokens"] and again["cached"] == 0 and totals["load_errors"] > 0


def test_a_mamba_hybrid_starts_and_answers_with_the_connector_on(
    engine_pool: PoolConfig, models: dict[str, str], tmp_path: Path
) -> None:
    """Falcon-H1 (vLLM's CPU engine runs Mamba-2 hybrids with its prefix cache off only): with the connector on the
    engine starts and answers as without it; the pool serves it nothing (the Mamba state is kept at no chunk's
    end), and says so."""
    model = models["falcon-h1-mamba"]
    with engine({"model": model, "prefix_caching": False}, tmp_path / "plain.log") as plain:
        [want] = plain.generate([P])
    settings = {"model": model, "prefix_caching": False, "connector": extra_config(engine_pool, model_id="falcon")}
    with engine(settings, tmp_path / "falcon.log") as e:
        [got, again] = e.generate([P, P])
        state = e.ask(connector=True)
    assert got["tokens"] == want["tokens"] and again["tokens"] == want["tokens"]
    assert state["layers"] == 2 and "loaded_tokens" not in state["totals"] and "saved_tokens" not in state["totals"]
    assert "served without the pool" in (tmp_path / "falcon.log").read_text()
