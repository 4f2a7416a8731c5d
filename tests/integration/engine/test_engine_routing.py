"""Routing over real vLLM engines: their KV events rebuild each engine's prefix cache in the router, and a prompt
goes to the engine that holds it; round-robin sends it elsewhere, where the pool serves it from the other node.

Two engines (the tiny random Llama, kvpool's connector) on the session's Ray nodes 127.0.0.2 and .3, their events
to one SUB socket, their cost models measured by :func:`calibrate` as the front does."""

import time
from pathlib import Path

from engines import CHUNK, ENV, P, R, extra_config
from http_asks import ask_app

from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.namespace import Namespace
from kvpool.pool.config import PoolConfig
from kvpool.prefill_decode.routing.engine_router import EngineEvents
from kvpool.prefill_decode.routing.router import Policy
from kvpool.prefill_decode.vllm.front import (
    EngineFront,
    calibrate,
    make_engine_app,
    model_spec,
    start_engine_lanes,
)
from kvpool.prefill_decode.vllm.zygote import Zygote

BLOCK = 32  #: vLLM's block size in these engines


def _until(predicate, what: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_prompt_goes_to_the_engine_whose_own_cache_holds_it(
    engine_pool: PoolConfig, model_dir: str, tmp_path: Path, zygote: Zygote
) -> None:
    events = EngineEvents("tcp://127.0.0.2:*", ["engine0", "engine1"])
    etcd = EtcdClient(engine_pool.metadata)
    cache = MetadataCache(etcd, Namespace(engine_pool.metadata.cluster)).start()
    lanes = start_engine_lanes(
        {"model": model_dir},
        extra_config(engine_pool),
        ["127.0.0.2", "127.0.0.3"],
        events.endpoint,
        tmp_path,
        ENV,
        zygote=zygote,
    )
    try:
        assert lanes[0].node != lanes[1].node
        costs = calibrate(lanes, model_spec(model_dir), CHUNK, tokens=600)
        assert all({"dram", "peer"} <= set(c.hardware.bandwidth) and c.hardware.step_s > 0 for c in costs)
        aware = EngineFront.over(lanes, events, costs, cache.replicas, CHUNK, Policy.CACHE_AWARE)

        first = aware.complete(P, max_tokens=4)
        held = (len(P) - 1) // BLOCK * BLOCK  # vLLM caches whole blocks, the last token's not before it is computed
        _until(lambda: events.cached_tokens(lanes[first.lane].topic, P) == held, "the engine's stored-block events")
        other = 1 - first.lane
        assert events.cached_tokens(lanes[other].topic, P) == 0

        again = aware.complete(P, max_tokens=4)
        assert again.lane == first.lane and again.quote.decision.tier == "local"
        assert again.cached == held  # what vLLM says it did not compute is what the events said it held
        assert again.tokens == first.tokens

        # round-robin's next turn is the other engine: it holds nothing, the pool holds P's two chunks on the first
        # engine's node, so the other engine reads them from there
        robin = EngineFront.over(lanes, events, costs, cache.replicas, CHUNK, Policy.ROUND_ROBIN)
        _until(lambda: len(cache.replicas(aware.router.keys(P, None)[1][-1])) > 0, "the saved chunks' placements")
        robin.complete(R, max_tokens=1)  # turn 0: engine 0
        moved = robin.complete(P, max_tokens=4)
        assert moved.lane == 1
        expected_tier = "local" if first.lane == 1 else "peer"
        assert moved.quote.decision.tier == expected_tier
        if first.lane == 0:
            assert moved.cached == 2 * CHUNK  # the pool's chunks, read from the other node
        assert moved.tokens == first.tokens

        # vLLM's reset_prefix_cache clears an engine's blocks, and its AllBlocksCleared event the router's index
        lanes[first.lane].engine.generate([R], reset=True, max_tokens=1)
        _until(lambda: events.cached_tokens(lanes[first.lane].topic, P) == 0, "the cleared engine's events")
        assert events.gaps == 0

        # the HTTP front over the engines: answers as the engines do; bad prompts are 400s and the engines go on
        app = make_engine_app(aware, "tiny-llama-vllm-test", vocab=4096)
        asks = [
            {"prompt": P, "max_tokens": 4},
            {"prompt": [5000], "max_tokens": 1},
            {"prompt": [1] * 5000, "max_tokens": 1},
            {"prompt": R, "max_tokens": 1},
        ]
        got = ask_app(app, [("", body) for body in asks] + [("sk-1", asks[0])])
        (ok, answer), (vocab, why), (long, refused), (after, _), (tenant, no_tenants), (stats, seen) = got
        assert ok == 200 and answer["choices"][0]["tokens"] == first.tokens and answer["kvpool"]["cached_tokens"] > 0
        assert vocab == 400 and "vocabulary size 4096" in why["error"]["message"]
        assert long == 400 and "the engine refused the request" in refused["error"]["message"]
        assert after == 200
        assert tenant == 400 and "serves no tenants" in no_tenants["error"]["message"]
        assert stats == 200 and [e["topic"] for e in seen["engines"]] == ["engine0", "engine1"]
        assert seen["router"]["requests"] == 5 and seen["events"]["gaps"] == 0
    finally:
        for lane in lanes:
            lane.engine.close()
        events.close()
        cache.close()
        etcd.close()
