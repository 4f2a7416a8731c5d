"""KvPoolConnector on real vLLM engines (CPU) and a real pool: reuse across engines, P/D across Ray nodes, faults."""

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import ray
import torch
import zmq
from engines import CHUNK, P, Q, R, S, engine, extra_config, prompt, reloaded
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.core.keys import CacheIdentity, chunk_keys, layer_key
from kvpool.core.types import Tier
from kvpool.errors import ConfigError, WorkerUnavailable
from kvpool.metadata.identities import fingerprint
from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig
from kvpool.pool.protocol import actor_name
from kvpool.pool.scrape import scrape
from kvpool.pool.segment import DramSegment
from kvpool.pool.tenants import Tenants
from kvpool.prefill_decode.vllm.config import ConnectorConfig
from kvpool.prefill_decode.vllm.groups import NULL_BLOCK, KvGroups, PoolLayer
from kvpool.prefill_decode.vllm.scheduler import KvPoolMetadata, Transfer
from kvpool.prefill_decode.vllm.worker import WorkerSide
from kvpool.prefill_decode.vllm.zygote import ForkedProcess

LAYERS = 4
#: each engine test starts vLLM engines (20-60 s each on 2 busy cores): more than the suite's 300 s per test
pytestmark = pytest.mark.timeout(900)


def same_answer(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Same greedy tokens and the same log-probabilities (to float32 rounding of a differently batched prefill)."""
    return got["tokens"] == want["tokens"] and all(
        math.isclose(a, b, abs_tol=1e-3) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)
    )


def pool_keys(identity: dict[str, Any], tokens: list[int]) -> list[list[bytes]]:
    """The pool keys of a prompt's full chunks, per chunk, per layer."""
    return [[layer_key(k, layer) for layer in range(LAYERS)] for k in chunk_keys(CacheIdentity(**identity), tokens)]


def wait_for(client: PoolClient, keys: list[bytes], timeout_s: float = 120.0) -> None:
    assert client.cache.wait_until(lambda c: all(c.replicas(k) for k in keys), timeout_s), "saves never arrived"


class KvEvents:
    """A SUB socket that an engine given its endpoint publishes vLLM's KV events to (vLLM connects to a
    non-wildcard endpoint), decoded with vLLM's own classes: kvpool's events in order, and which tokens each of the
    engine's own blocks holds, by block hash."""

    def __init__(self) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        self._sub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.pool: list[Any] = []  #: BlockStored / BlockRemoved of kvpool's chunks
        self.own: dict[Any, tuple[int, ...]] = {}  #: the engine's own blocks: their tokens, by hash

    def drain(self) -> None:
        while True:
            try:
                frames = self._sub.recv_multipart()
            except zmq.Again:
                return
            for event in self._decoder.decode(frames[-1]).events:
                if getattr(event, "ownership", None) == "kvpool":
                    self.pool.append(event)
                elif type(event).__name__ == "BlockStored" and event.medium == "GPU":
                    size = event.block_size
                    for i, h in enumerate(event.block_hashes):
                        self.own[h] = tuple(event.token_ids[i * size : (i + 1) * size])

    def stored(self, tokens: list[int]) -> list[Any]:
        return [e for e in self.pool if type(e).__name__ == "BlockStored" and e.token_ids == tokens]

    def __enter__(self) -> "KvEvents":
        return self

    def __exit__(self, *exc: object) -> None:
        self._sub.close(0)
        self._ctx.term()


def drive_until(e: Any, events: KvEvents, done: Any, timeout_s: float = 120.0) -> None:
    """Short requests to engine ``e`` (vLLM publishes what its connector hands it at its steps) until ``done()``."""
    deadline = time.monotonic() + timeout_s
    while True:
        events.drain()
        if done():
            return
        assert time.monotonic() < deadline, f"kvpool's events so far: {events.pool}"
        e.generate([prompt(9, 40)], max_tokens=1)


def check_pool_events(a: Any, events: KvEvents, client: PoolClient, identity: dict[str, Any]) -> None:
    """Engine A's own KV-event stream carries a ``BlockStored`` of each chunk it saved of P and R: medium ``CPU``
    (the pool's DRAM), vLLM's hashes of the same blocks A cached itself, their tokens; a chunk removed from the pool
    is a ``BlockRemoved`` of those hashes, and stored again when A saves it again."""
    chunks = [x[c * CHUNK : (c + 1) * CHUNK] for x in (P, R) for c in range(2)]
    drive_until(a, events, lambda: all(events.stored(c) for c in chunks))
    for c in chunks:
        [e] = events.stored(c)
        assert (e.medium, e.block_size, len(e.block_hashes)) == ("CPU", 32, CHUNK // 32)
        assert [events.own.get(h) for h in e.block_hashes] == [tuple(c[i : i + 32]) for i in range(0, CHUNK, 32)]
    [r1] = events.stored(chunks[3])
    client.remove_batch(pool_keys(identity, R)[1])
    drive_until(a, events, lambda: any(type(e).__name__ == "BlockRemoved" for e in events.pool))
    [gone] = [e for e in events.pool if type(e).__name__ == "BlockRemoved"]
    assert (gone.block_hashes, gone.medium) == (r1.block_hashes, "CPU")
    [again] = a.generate([R], reset=True)  # loads R's first chunk, computes and saves the second again
    assert again["cached"] == CHUNK
    drive_until(a, events, lambda: len(events.stored(chunks[3])) == 2)


def check_prefetch_hint(b: Any, client: PoolClient, keys: list[list[bytes]], want: dict[str, Any]) -> None:
    """P's chunks moved to the NVMe of engine B's node, then P asked for with kvpool's prefetch hint: B's scheduler
    has them promoted into its node's DRAM (on the thread of a pool client of its own, made now: B's first hint
    always starts one, whatever its watch shows yet) before vLLM schedules the request, which then loads them all
    and answers as cold.  A malformed hint is counted and the request served as without one."""
    flat = [k for chunk in keys for k in chunk]
    client.move(flat, Tier.NVME)
    assert all({p.tier for p in client.cache.replicas(k)} == {Tier.NVME} for k in flat)
    [hinted] = b.generate([P], reset=True, kv_transfer_params={"kvpool": {"prefetch": True}})
    assert hinted["cached"] == 2 * CHUNK and same_answer(hinted, want)
    assert client.cache.wait_until(lambda c: all(Tier.DRAM in {p.tier for p in c.replicas(k)} for k in flat), 10)
    [plain] = b.generate([P], reset=True, kv_transfer_params={"kvpool": {"prefetch": "yes"}})
    assert plain["cached"] == 2 * CHUNK and same_answer(plain, want)
    totals = b.ask(connector=True)["totals"]
    got = {name: n for name, n in totals.items() if name.startswith("prefetch_")}
    assert got == {"prefetch_started": 1, "prefetch_promoted": len(flat), "prefetch_copied": 0, "prefetch_bad_hint": 1}


# -- without an engine: the worker side's byte moves, and the extra config ----------------------------------------


def step_loads(side: WorkerSide, meta: KvPoolMetadata) -> set[int]:
    """One step of ``meta``'s loads through the worker side, every layer waited for; the blocks that failed to load."""
    side.start_step(meta)
    for name in side.layers:
        side.wait_layer(name)
    side.end_step(meta)
    return side.take_load_errors()


def paged_saver(
    engine_pool: PoolConfig, model: str, blocks: int
) -> tuple[ConnectorConfig, CacheIdentity, KvGroups, dict[str, torch.Tensor], WorkerSide]:
    """A worker side over three layers of random paged KV (vLLM's CPU layout, 32-token blocks, 64-token chunks), the
    pool's saver: its config, cache identity, groups, KV tensors and itself."""
    config = ConnectorConfig.from_extra(extra_config(engine_pool, chunk_size=64))
    identity = CacheIdentity(model=model, kv_dtype="float32", layout="vllm-test:[B,H,bs,2D]", chunk_size=64)
    src = {f"layers.{i}.attn": torch.randn(blocks, 2, 32, 128) for i in range(3)}
    groups = KvGroups(tuple(PoolLayer(name, i, 0) for i, name in enumerate(src)), 32, 64)
    saver = WorkerSide(config, identity, groups, blocks)
    saver.register(src)
    return config, identity, groups, src, saver


def test_worker_side_saves_blocks_and_loads_them_into_other_blocks(engine_pool: PoolConfig) -> None:
    """Save three chunks of paged KV (vLLM's CPU layout, blocks scattered) and load them into other blocks of
    another cache: byte-exact, layer by layer; blocks of vLLM's own prefix hits are left alone; a chunk missing
    from the pool is reported as its blocks' load errors."""
    blocks = 16
    config, identity, groups, src, saver = paged_saver(engine_pool, "worker-test", blocks)
    tokens = list(range(200))  # 3 full chunks of 64 tokens: 6 blocks
    meta = KvPoolMetadata(saves=[Transfer("r1", tokens[:192], 0, 3, [[5, 2, 9, 11, 0, 7]])])
    saver.start_step(meta)
    for name in src:
        saver.wait_layer(name)
        saver.layer_done(name, meta)
    saver.end_step(meta)
    deadline = time.monotonic() + 60
    while saver.finished({"r1"}) != {"r1"}:
        assert time.monotonic() < deadline, "saves of r1 never reported done"
        time.sleep(0.05)
    assert saver.counts.totals["saved_tokens"] == 3 * 64 and "save_errors" not in saver.counts.totals

    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    loader = WorkerSide(config, identity, groups, blocks)
    loader.register(dst)
    # chunk 0 is a prefix-cache hit of the engine (blocks 1, 3); chunks 1-2 come from the pool
    load = KvPoolMetadata(loads=[Transfer("r2", tokens[:192], 1, 3, [[1, 3, 4, 5, 8, 9]], write_from=2)])
    assert step_loads(loader, load) == set()
    for name in src:
        assert torch.equal(dst[name][[4, 5, 8, 9]], src[name][[9, 11, 0, 7]])
        assert not dst[name][[1, 3]].any()  # never written
    # straight between the pool and the blocks: neither side staged a byte (nothing here was the engine's own)
    assert saver._save_staging.nbytes == 0 and loader.blocks.staging.nbytes == 0
    # the engine's own blocks reach into chunk 1 (block 12), and a block is the null block: both left alone
    dst2 = {name: torch.zeros_like(t) for name, t in src.items()}
    other = WorkerSide(config, identity, groups, blocks)
    other.register(dst2)
    mid = Transfer("r3", tokens[:192], 1, 3, [[1, 3, 12, 13, NULL_BLOCK, 14]], write_from=3)
    # layer by layer, and every layer in one batch (a load the forward waits for whole: the skipped blocks of all
    # layers land in regions of one sink)
    for whole in (False, True):
        for t in dst2.values():
            t.zero_()
        assert step_loads(other, KvPoolMetadata(loads=[replace(mid, whole_before_forward=whole)])) == set()
        for name in src:
            assert torch.equal(dst2[name][[13, 14]], src[name][[11, 7]])
            assert not dst2[name][[NULL_BLOCK, 12]].any()
    other.close()

    client = saver.client
    assert client is not None
    saved = [layer_key(k, layer) for k in chunk_keys(identity, tokens) for layer in range(len(src))]
    assert {p.identity for k in saved for p in client.cache.replicas(k)} == {fingerprint(identity)}  # for events
    client.remove(layer_key(chunk_keys(identity, tokens)[2], 1))  # chunk 2 of layer 1 is gone
    assert step_loads(loader, load) == {8, 9} and loader.counts.totals["load_errors"] == 2
    for t in dst.values():
        t.zero_()
    whole = KvPoolMetadata(loads=[replace(load.loads[0], whole_before_forward=True)])
    assert step_loads(loader, whole) == {8, 9} and loader.counts.totals["load_errors"] == 4
    for name in src:  # the chunks that came landed in their blocks, whatever layer's object failed
        assert torch.equal(dst[name][[4, 5]], src[name][[9, 11]])
    saver.close()
    loader.close()


def test_a_load_with_layerwise_off_reads_every_layer_in_one_batch(
    engine_pool: PoolConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``layerwise: false``: a load that ends before the prompt's end reads all layers with one ``get_into_batch``
    (one round of node calls) before the forward, where the default reads one a layer; the same bytes land."""
    blocks = 8
    config, identity, groups, src, saver = paged_saver(engine_pool, "layerwise-test", blocks)
    tokens = list(range(160))  # 2 full chunks of 64 tokens, and a tail the engine computes
    meta = KvPoolMetadata(saves=[Transfer("s", tokens[:128], 0, 2, [[5, 2, 6, 1]])])
    saver.start_step(meta)
    for name in src:
        saver.layer_done(name, meta)
    saver.end_step(meta)
    saver.drain({"s"})  # the put has run
    load = KvPoolMetadata(loads=[Transfer("l", tokens[:128], 0, 2, [[2, 3, 4, 7]])])
    calls: list[int] = []  #: keys per get_into_batch
    batch = PoolClient.get_into_batch
    monkeypatch.setattr(PoolClient, "get_into_batch", lambda c, keys, *a: calls.append(len(keys)) or batch(c, keys, *a))
    for layerwise, batches in ((True, len(src)), (False, 1)):
        dst = {name: torch.zeros_like(t) for name, t in src.items()}
        side = WorkerSide(msgspec.structs.replace(config, layerwise=layerwise), identity, groups, blocks)
        side.register(dst)
        calls.clear()
        assert step_loads(side, load) == set()
        assert len(calls) == batches and sum(calls) == 2 * len(src)
        for name in src:
            assert torch.equal(dst[name][[2, 3, 4, 7]], src[name][[5, 2, 6, 1]])
        side.close()
    saver.close()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"etcd": 5}, "etcd` must be a list"),
        ({"chunk_size": "256"}, "chunk_size` expected `int`, got str"),
        ({"chunck_size": 256}, "unknown field `chunck_size`"),
        ({"replicas": 0}, "replicas` expected `int` >= 1"),
        ({"load_failure": "ignore"}, "load_failure` must be"),
        ({"etcd": ["nohost"]}, "must be an etcd endpoint: host:port"),
        ("etcd=1", "expected `object`, got `str`"),
    ],
)
def test_malformed_extra_config_is_a_config_error(extra: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra(extra).metadata()


# -- real engines -------------------------------------------------------------------------------------------------


def test_a_fresh_engine_answers_from_the_pool_as_if_it_had_computed(
    engine_pool: PoolConfig, model_dir: str, baseline: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Engine A (forked from the session's zygote) computes and saves; a fresh engine B (another process, started
    afresh once A's saves are in, another PYTHONHASHSEED, which never computed these prompts) is given the full chunks
    by the pool and answers exactly as without the connector (also for a prompt that ends on a chunk), also when a
    request's hint has the chunks brought from NVMe first.  KV altered in the pool changes B's answer (so the check
    can fail); a corrupt chunk is a miss that B recomputes, right answer."""
    # a hinted request waits up to 60 s for its prefetch (the default 2 s is short for a loaded 2-core machine)
    settings = {"model": model_dir, "connector": extra_config(engine_pool, prefetch_wait_s=60.0)}
    with PoolClient(engine_pool) as client, KvEvents() as events:
        # A publishes vLLM's KV events: its own blocks', and the pool's chunks it saved (check_pool_events)
        with engine({**settings, "kv_events": {"endpoint": events.endpoint}}, tmp_path / "a.log") as a:
            # ZeroMQ drops what a PUB socket sends before its subscriber's handshake is through: a first short prompt
            drive_until(a, events, lambda: bool(events.own))
            got = a.generate([P, R])
            assert [g["cached"] for g in got] == [0, 0]
            assert same_answer(got[0], baseline["P"]) and same_answer(got[1], baseline["R"])
            identity = a.ask(connector=True)["identity"]
            check_pool_events(a, events, client, identity)
        p_keys, r_keys = pool_keys(identity, P), pool_keys(identity, R)
        wait_for(client, [k for chunk in p_keys + r_keys for k in chunk])
        # B starts once A's saves are in etcd, so its first read of the pool's chunks holds them: started beside A
        # it would learn of them only through its watch, which a loaded machine may deliver after B's first lookup
        with engine(settings, tmp_path / "b.log", hash_seed=2) as b:
            assert not isinstance(b.proc, ForkedProcess)  # another PYTHONHASHSEED than the zygote's: started afresh
            got = b.generate([P, Q])
            assert [g["cached"] for g in got] == [2 * CHUNK, 2 * CHUNK]
            assert same_answer(got[0], baseline["P"]) and same_answer(got[1], baseline["Q"])
            # a prompt that is exactly its chunks: all of them load, vLLM computes the last token again
            [whole] = b.generate([S], reset=True)
            assert whole["cached"] == 2 * CHUNK - 1 and same_answer(whole, baseline["S"])
            totals = b.ask(connector=True)["totals"]
            assert totals["loaded_tokens"] >= 2 * CHUNK and totals["load_errors"] == 0
            check_prefetch_hint(b, client, p_keys, baseline["P"])

            # different KV under P's keys: B now answers differently, from what the pool gave it
            flat = [k for chunk in p_keys for k in chunk]
            sizes = [client.cache.replicas(k)[0].size for k in flat]
            client.remove_batch(flat)
            rng = np.random.default_rng(0)
            client.put_batch(
                [(k, rng.standard_normal(n // 4).astype(np.float32)) for k, n in zip(flat, sizes, strict=True)]
            )
            wait_for(client, flat)
            # B learns of the new chunks through its etcd watch, which may come after the test's own (reloaded asks
            # again until it has; B's saves of a miss meanwhile find the keys held and leave the altered KV alone)
            altered, _ = reloaded(b, P, 2 * CHUNK)
            assert altered["cached"] == 2 * CHUNK and not same_answer(altered, baseline["P"])

            # one byte flipped in one of R's chunks: a miss, recomputed, the right answer
            victim = r_keys[1][2]
            [p] = client.cache.replicas(victim)
            info = ray.get(ray.get_actor(actor_name(p.node), namespace=engine_pool.namespace).info.remote())
            with DramSegment.attach(info.dram_path, info.dram_capacity) as seg:
                seg.write(p.offset + 100, bytes([seg.view(p.offset + 100, 1)[0] ^ 0xFF]))
            [recomputed] = b.generate([R], reset=True)
            assert same_answer(recomputed, baseline["R"])
            totals = b.ask(connector=True)["totals"]
            assert totals["load_errors"] > 0 and totals["miss_read_failed"] > 0  # kvpool_misses_total{cause}
            assert client.cache.wait_until(lambda c: not c.replicas(victim), 10)  # the corrupt replica was dropped
            [again] = b.generate([R], reset=True)  # stops at the dropped chunk (and says why) unless B saved it again
            assert same_answer(again, baseline["R"])
            corrupt = b.ask(connector=True)["totals"].get("miss_corrupt", 0)
            assert (again["cached"], corrupt >= 1) in ((CHUNK, True), (2 * CHUNK, False)), (again["cached"], corrupt)


def test_etcd_unreachable_means_no_hits_and_normal_answers(
    pool_config: PoolConfig, model_dir: str, baseline: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """No pool is started for it: without etcd, the connector finds no pool node to reach anyway."""
    settings = {"model": model_dir, "connector": extra_config(pool_config, etcd=["127.0.0.1:9"])}
    with engine(settings, tmp_path / "etcd-down.log") as e:
        assert isinstance(e.proc, ForkedProcess)  # from the session's zygote (B of the fresh-engine test: not)
        [got] = e.generate([P])
    assert got["cached"] == 0 and same_answer(got, baseline["P"])


def test_tenants_by_cache_salt_never_hit_each_others_chunks(
    engine_pool: PoolConfig, model_dir: str, baseline: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """With a tenants file, a request's ``cache_salt`` is its tenant's API key: its chunks are keyed in the tenant's
    chain and charged to it.  The same prompt from another tenant finds nothing in the pool; a request whose salt is no
    tenant's key is served without the pool; every answer is the model's."""
    from kvpool.pool.tenants import new_secret

    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        f"[tenants.acme]\nsecret = '{new_secret()}'\napi_keys = ['sk-acme']\n"
        f"[tenants.globex]\nsecret = '{new_secret()}'\napi_keys = ['sk-globex']\n"
    )
    settings = {"model": model_dir, "connector": extra_config(engine_pool, tenants=str(tenants))}
    with PoolClient(engine_pool) as client, engine(settings, tmp_path / "tenants.log") as e:
        [first] = e.generate([P], salts=["sk-acme"])
        identity = CacheIdentity(**e.ask(connector=True)["identity"])
        acme = chunk_keys(identity, P[: 2 * CHUNK], Tenants.load(str(tenants)).scope("acme"))
        wait_for(client, [layer_key(k, layer) for k in acme for layer in range(4)])
        # the engine's own prefix cache emptied before each: what it gets, it gets from the pool
        [other] = e.generate([P], salts=["sk-globex"], reset=True)
        again, _ = reloaded(e, P, 2 * CHUNK, salt="sk-acme")
        [nobody] = e.generate([P], salts=["sk-unknown"], reset=True)
        [plain] = e.generate([P], reset=True)
        e.ask(connector=True)  # saves of the last steps are done by the time it answers
        unsalted = [layer_key(k, 0) for k in chunk_keys(identity, P[: 2 * CHUNK])]
        assert client.lookup_prefix(unsalted) == 0  # nothing of P was put under the identity's own chain
        used = {
            t: sum(scrape(n.metrics).get(f"kvpool_tenant_used_bytes{{{t},dram}}", 0) for n in client.cache.nodes())
            for t in ("acme", "globex")
        }
    assert [g["cached"] for g in (first, other, again, nobody, plain)] == [0, 0, 2 * CHUNK, 0, 0]
    assert all(same_answer(g, baseline["P"]) for g in (first, other, again, nobody, plain))
    assert used["acme"] > 0 and used["globex"] > 0  # each tenant's saves charged to it


def test_a_malformed_extra_config_stops_the_engine_at_start_with_a_clear_error(
    pool_config: PoolConfig, model_dir: str, tmp_path: Path
) -> None:
    settings = {"model": model_dir, "connector": extra_config(pool_config, chunk_size=100)}
    with pytest.raises(WorkerUnavailable, match="engine exited"):
        engine(settings, tmp_path / "bad.log")
    log = (tmp_path / "bad.log").read_text()
    assert "ConfigError" in log and "must be a multiple of vLLM's block size (32): e.g. 96" in log


# -- P/D: a producer engine and a consumer engine on two Ray nodes ------------------------------------------------


@ray.remote(num_cpus=0)
class EngineActor:
    """A vLLM engine inside a Ray actor pinned to one node (its connector's pool client is on that node)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import os

        from kvpool.prefill_decode.vllm.engine import ENGINE_ENV, start_engine

        os.environ.update({**ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"})
        self.llm = start_engine(settings)

    def generate(self, prompts: list[list[int]], reset: bool = False) -> list[dict[str, Any]]:
        from kvpool.prefill_decode.vllm.engine import generate

        return generate(self.llm, prompts, 8, reset)

    def totals(self) -> dict[str, float]:
        from kvpool.prefill_decode.vllm.engine import connector_state

        return connector_state()["totals"]  # type: ignore[no-any-return]


def via_ray_bytes(client: PoolClient) -> dict[str, int]:
    """Each pool node's count of KV bytes it sent as Ray call results (a one-sided read sends none)."""
    return {node: s["bytes_via_ray"] for node, s in client.stats()["nodes"].items()}


def engine_actor(node_id: str, settings: dict[str, Any]) -> Any:
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return EngineActor.options(scheduling_strategy=strategy).remote(settings)


def test_prefill_on_one_node_decode_on_another_and_the_holder_dying(
    engine_pool: PoolConfig, model_dir: str, baseline: dict[str, dict[str, Any]], ray_cluster: list[str]
) -> None:
    """The producer (kv_producer, 127.0.0.3) prefills; its step ends with the chunks in its node's DRAM.  The
    consumer (kv_consumer, 127.0.0.4) reads them one-sided from there — no KV byte through Ray — and answers as
    without the connector.  Then the holder's pool node is killed, its memory with it: the consumer still sees the
    placements (their lease has not expired), its load fails (a READ of the chunks where they were finds other bytes,
    the pinned read a dead node), vLLM recomputes, right answer, and the engine keeps serving."""
    producer_node, consumer_node = ray_cluster[1], ray_cluster[2]
    model = {"model": model_dir}
    producer = engine_actor(
        producer_node, {**model, "role": "kv_producer", "connector": extra_config(engine_pool, "127.0.0.3")}
    )
    consumer = engine_actor(
        consumer_node, {**model, "role": "kv_consumer", "connector": extra_config(engine_pool, "127.0.0.4")}
    )
    try:
        [prefilled] = ray.get(producer.generate.remote([P]))
        assert same_answer(prefilled, baseline["P"])
        with PoolClient(engine_pool) as client:
            held = [p for key, replicas in client.cache.chunks() for p in replicas]
            assert len(held) == 2 * LAYERS and {p.node for p in held} == {producer_node}
            assert {p.tier for p in held} == {Tier.DRAM}
            via_ray = via_ray_bytes(client)  # the session's pool: earlier tests' counts
            [decoded] = ray.get(consumer.generate.remote([P]))
            assert decoded["cached"] == 2 * CHUNK and same_answer(decoded, baseline["P"])
            assert via_ray_bytes(client) == via_ray
            assert ray.get(consumer.totals.remote())["loaded_bytes"] > 0

            holder = ray.get_actor(actor_name(producer_node), namespace=engine_pool.namespace)
            dram = ray.get(holder.info.remote()).dram_path
            ray.kill(holder)
            # a dead host's memory is gone; here its shared-memory file outlives the process (and a READ of it
            # would still find the chunks): their bytes go with it
            with open(dram, "r+b") as segment:
                for p in held:
                    segment.seek(p.offset)
                    segment.write(bytes(p.stored))
            assert all(client.exists(p.key) for p in held)  # the lease (30 s) keeps them listed
            [recomputed] = ray.get(consumer.generate.remote([P], True))
            assert same_answer(recomputed, baseline["P"])
            assert ray.get(consumer.totals.remote())["load_errors"] > 0
            [other] = ray.get(consumer.generate.remote([R]))
            assert same_answer(other, baseline["R"])
            # what the consumer's connector did reaches its pool node's Prometheus metrics
            node = ray.get_actor(actor_name(consumer_node), namespace=engine_pool.namespace)
            address = ray.get(node.info.remote()).metrics_address
            wanted = ("kvpool_engine_bytes_total{load}", "kvpool_engine_errors_total{load}")
            deadline = time.monotonic() + 30  # reports are sent without waiting: give them time to land
            while not all((metrics := scrape(address)).get(name, 0) > 0 for name in wanted):
                assert time.monotonic() < deadline, {name: metrics.get(name) for name in wanted}
                time.sleep(0.2)
    finally:
        for actor in (producer, consumer):
            ray.kill(actor)
