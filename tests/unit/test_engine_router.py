"""Routing over vLLM engines on constructed inputs: an engine's prefix cache rebuilt from vLLM-shaped KV events, and
the router's quote from it, the pool's placements and the queue.  The real engines' events and the route they
produce are tested in tests/integration/engine/test_engine_routing.py."""

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import zmq

from kvpool.core.types import Placement, Tier
from kvpool.errors import ConfigError
from kvpool.metadata.zmq_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvpool.pool.tenants import Scope
from kvpool.prefill_decode.routing.cost import Action, CostModel, Hardware, model_spec
from kvpool.prefill_decode.routing.engine_router import BlockIndex, EngineEvents, EngineRouter
from kvpool.prefill_decode.routing.router import Policy, decide
from kvpool.prefill_decode.vllm.front import model_spec as model_spec_of

BS = 4  #: tokens per vLLM block here
CHUNK = 8  #: tokens per pool chunk (two blocks)
NODES = ["node-a", "node-b", "node-c"]


def stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    extra: list[tuple[str, ...] | None] | None = None,
    medium: str = "GPU",
) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, medium, None, extra_keys=extra)


def test_the_index_walks_a_prompt_block_by_block() -> None:
    index = BlockIndex()
    assert index.cached_tokens(list(range(12))) == 0  # nothing seen: not even the block size is known
    index.apply(stored([1, 2], None, list(range(8))))
    index.apply(stored([3], 2, [8, 9, 10, 11]))
    assert index.cached_tokens(list(range(14))) == 12  # three whole blocks; the tail is not a block
    assert index.cached_tokens([*range(8), 0, 0, 0, 0]) == 8  # the third block differs
    assert index.cached_tokens([5, *range(1, 12)]) == 0  # the first block differs: nothing, whatever follows
    index.apply(BlockRemoved([2], "GPU"))
    assert index.cached_tokens(list(range(12))) == 4  # a freed block cuts the prefix there
    index.apply(AllBlocksCleared())
    assert index.cached_tokens(list(range(12))) == 0 and len(index) == 0


def test_a_salted_prompt_and_an_unsalted_one_never_match() -> None:
    """vLLM hashes a ``cache_salt`` into a prompt's first block (its extra keys): so does the index."""
    index = BlockIndex()
    index.apply(stored([1, 2], None, list(range(8)), extra=[("acme",), None]))
    assert index.cached_tokens(list(range(8))) == 0
    assert index.cached_tokens(list(range(8)), salt="acme") == 8
    assert index.cached_tokens(list(range(8)), salt="globex") == 0


def test_offloaded_copies_and_malformed_events_are_not_the_engines_own_prefix() -> None:
    index = BlockIndex()
    index.apply(stored([1], None, [0, 1, 2, 3], medium="CPU"))  # vLLM's own CPU offloading: a read, not a hit
    index.apply(stored([2], None, [0, 1, 2]))  # three tokens for one block of four: skipped
    assert index.cached_tokens([0, 1, 2, 3]) == 0
    # the pool's chunks KvPoolConnector publishes in the engine's stream carry vLLM's hashes of the engine's blocks:
    # the pool dropping a chunk leaves the engine's own block of the same hash where it is
    index.apply(stored([3], None, [0, 1, 2, 3]))
    index.apply(BlockRemoved([3], "CPU", ownership="kvpool"))
    assert index.cached_tokens([0, 1, 2, 3]) == 4


def test_a_gap_in_an_engines_sequence_clears_its_index_and_only_its() -> None:
    events = EngineEvents("tcp://127.0.0.2:*", ["e0", "e1"])
    try:
        batch = KVEventBatch(0.0, [stored([1, 2], None, list(range(8)))])
        events.apply("e0", 0, batch)
        events.apply("e1", 0, batch)
        events.apply("nobody", 0, batch)  # another engine's topic: ignored
        assert events.cached_tokens("e0", list(range(8))) == events.cached_tokens("e1", list(range(8))) == 8
        events.apply("e0", 2, KVEventBatch(0.0, []))  # batch 1 was dropped: what it said is unknown
        assert events.cached_tokens("e0", list(range(8))) == 0 and events.gaps == 1
        assert events.cached_tokens("e1", list(range(8))) == 8
    finally:
        events.close()


def test_bad_engine_event_endpoints_and_topics_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="distinct"):
        EngineEvents("tcp://127.0.0.2:*", ["e0", "e0"])
    with pytest.raises(ConfigError, match=r"`topics\[1\]` must be a topic: a non-empty string, got str ''"):
        EngineEvents("tcp://127.0.0.2:*", ["e0", ""])
    with pytest.raises(ConfigError, match="cannot bind"):
        EngineEvents("nonsense://x", ["e0"])
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.2")
    try:
        with pytest.raises(ConfigError, match="pick a free port"):
            EngineEvents(f"tcp://127.0.0.2:{port}", ["e0"])
    finally:
        taken.close(0)
        ctx.term()


def _cost() -> CostModel:
    return CostModel(model_spec("llama-3-8b"), Hardware(1e12, {"dram": 20e9, "peer": 4e9}, "test", step_s=0.01))


def test_a_prefix_held_by_the_engine_is_neither_read_nor_computed() -> None:
    cost = _cost()
    held = decide(cost, 4096, 0, {}, local_tokens=2048)
    assert held.action is Action.RECOMPUTE and held.cached_tokens == 2048 and held.tier == "local"
    assert held.recompute_s == pytest.approx(cost.prefill_s(4096, 2048))
    # the pool holds 3072: only the 1024 past the engine's own prefix are read
    more = decide(cost, 4096, 3072, {"peer": 1}, local_tokens=2048)
    assert more.action is Action.RELOAD
    assert more.reload_then_prefill_s == pytest.approx(cost.transfer_s(1024, "peer") + cost.prefill_s(4096, 3072))
    assert decide(cost, 4096, 2048, {"dram": 1}, local_tokens=4096).cached_tokens == 4095  # the last token: computed


def _router(local: dict[int, int], where: dict[bytes, list[tuple[str, Tier]]]) -> EngineRouter:
    def keys(tokens: Sequence[int], scope: Scope | None) -> list[list[bytes]]:
        return [[b"%d-%d-L%d" % (tokens[0], c, layer) for layer in range(2)] for c in range(len(tokens) // CHUNK)]

    table = {k: [Placement(k, n, t, 0, 1 << 20, 1 << 20, 0) for n, t in v] for k, v in where.items()}
    return EngineRouter(
        NODES,
        [_cost()] * 3,
        keys,
        CHUNK,
        lambda k: table.get(k, []),
        lambda lane, tokens, scope: local.get(lane, 0),
        Policy.CACHE_AWARE,
    )


def test_the_engine_holding_the_prefix_wins_over_one_that_would_read_it_from_the_pool() -> None:
    prompt = [7] * (64 * CHUNK)
    pool = {b"7-%d-L%d" % (c, layer): [("node-a", Tier.DRAM)] for c in range(64) for layer in range(2)}
    router = _router({2: 64 * CHUNK}, pool)
    quotes = router.quotes(prompt)
    assert [q.decision.tier for q in quotes] == ["dram", "peer", "local"]
    assert quotes[2].ttft_s < quotes[0].ttft_s < quotes[1].ttft_s
    assert router.pick(prompt).lane == 2


def test_a_prompt_queued_on_an_engine_counts_as_held_there() -> None:
    router = _router({}, {})
    prompt = [9] * (16 * CHUNK)
    first = router.pick(prompt)
    quotes = router.quotes(prompt)
    assert [q.decision.cached_tokens for q in quotes] == [16 * CHUNK - 1 if i == first.lane else 0 for i in range(3)]
    router.release(first)
    assert all(q.decision.cached_tokens == 0 for q in router.quotes(prompt))


def test_a_directory_without_a_model_config_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a Llama-style model config"):
        model_spec_of(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    with pytest.raises(ConfigError, match="not a Llama-style model config"):
        model_spec_of(tmp_path)


class _BlockedEngine:
    """An engine whose answers wait for ``gate``: the first request holds it while a second one queues."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[dict[str, object]]:
        assert self.gate.wait(30)
        return [{"tokens": [1], "cached": 0}]


class _Prefetches:
    def __init__(self) -> None:
        self.asked: list[tuple[list[bytes], str]] = []

    def submit(self, keys: Sequence[bytes], node: str) -> None:
        self.asked.append((list(keys), node))


def test_a_request_that_waits_for_its_engine_has_its_chunks_prefetched_to_that_node() -> None:
    from kvpool.prefill_decode.vllm.front import EngineFront, EngineLane

    engine, prefetches = _BlockedEngine(), _Prefetches()
    tokens = [7] * 32  # 4 chunks, each of 2 layer objects, on another node's NVMe

    def keys(tokens: Sequence[int], scope: Scope | None) -> list[list[bytes]]:
        return [[b"%d-L%d" % (c, layer) for layer in range(2)] for c in range(len(tokens) // CHUNK)]

    flat = [k for chunk in keys(tokens, None) for k in chunk]
    table = {k: [Placement(k, "node-b", Tier.NVME, 0, 1 << 20, 1 << 20, 0)] for k in flat}
    router = EngineRouter(["node-a"], [_cost()], keys, CHUNK, lambda k: table[k], lambda *_: 0)
    lanes = [EngineLane(engine, "node-a", "engine0")]  # type: ignore[arg-type]
    front = EngineFront(lanes, None, router, prefetches)  # type: ignore[arg-type]
    first = threading.Thread(target=front.complete, args=(tokens,))
    first.start()
    while not front._locks[0].locked():
        time.sleep(0.01)
    second = threading.Thread(target=front.complete, args=(tokens,))
    second.start()
    deadline = time.monotonic() + 30
    while not prefetches.asked and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.gate.set()
    first.join()
    second.join()
    assert prefetches.asked == [(flat, "node-a")]  # only the request that waited, into its engine's node
    front.complete(tokens)  # alone: nothing to wait for, nothing prefetched
    assert len(prefetches.asked) == 1
