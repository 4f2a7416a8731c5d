"""The scheduler side of vLLM's connector over a fake watch cache and fake scheduler outputs: the lookup vLLM asks
for, the loads and saves planned per step from one tracker per request, and when vLLM may free a request's blocks.
Needs vLLM's connector base class (a skip where vLLM is optional and absent, as the engine tests)."""

from types import SimpleNamespace
from typing import Any

import pytest
from engine_needed import vllm_module
from test_connector_core import FakeCache
from test_request_prefetches import FakeConnection

from kvpool.core.keys import CacheIdentity, chunk_keys, layer_key
from kvpool.core.types import Tier
from kvpool.prefill_decode.connector_core.prefetch import RequestPrefetches
from kvpool.prefill_decode.vllm.config import ConnectorConfig
from kvpool.prefill_decode.vllm.groups import KvGroups, PoolLayer

pytestmark = pytest.mark.slow  # imports vLLM (20-30 s on a busy box), once for the whole run

CHUNK, BLOCK, LAYERS = 8, 4, 2
IDENTITY = CacheIdentity(model="m", kv_dtype="float32", layout="vllm-test", chunk_size=CHUNK)


@pytest.fixture
def scheduler(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = vllm_module("kvpool.prefill_decode.vllm.scheduler")
    monkeypatch.setattr(module.SchedulerSide, "_connect", lambda self: None)  # no etcd: the fake cache below
    groups = KvGroups(tuple(PoolLayer(f"layers.{i}", i, 0) for i in range(LAYERS)), BLOCK, CHUNK)
    side = module.SchedulerSide(ConnectorConfig(chunk_size=CHUNK), [IDENTITY], groups)
    return module, side


def hold(side: Any, tokens: list[int], chunks: int) -> None:
    keys = chunk_keys(IDENTITY, tokens)[:chunks]
    side.cache = FakeCache({layer_key(k, layer) for k in keys for layer in range(LAYERS)})


def step(new: tuple[Any, ...] = (), cached: Any = None, scheduled: dict[str, int] | None = None) -> Any:
    none = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or none, num_scheduled_tokens=scheduled or {}
    )


def test_a_partial_hit_loads_the_held_chunks_and_saves_the_next(scheduler: Any) -> None:
    module, side = scheduler
    tokens = list(range(26))  # 3 full chunks and 2 tokens; the pool holds the first 2 chunks
    hold(side, tokens, 2)
    request = SimpleNamespace(request_id="r1", prompt_token_ids=tokens)
    assert side.matched(request, 0) == 2 * CHUNK
    side.allocated(request, 2 * CHUNK)
    blocks = list(range(10, 17))
    new = SimpleNamespace(req_id="r1", prompt_token_ids=tokens, block_ids=[blocks], num_computed_tokens=0)
    meta = side.build(step((new,), scheduled={"r1": 26}))
    assert meta.loads == [module.Transfer("r1", tokens[:16], 0, 2, [blocks[:4]])]
    assert meta.saves == [module.Transfer("r1", tokens[:24], 2, 3, [blocks[:6]])]  # chunk 2, computed this step
    assert meta.counts == {"lookup_tokens": 26, "hit_tokens": 16, "miss_never_stored": 1}
    assert side.build(step()).loads == [] and side.finished("r1") is True  # keep its blocks until saved
    assert side.finished("r1") is False


def test_a_chunked_prefill_saves_each_chunk_as_it_completes(scheduler: Any) -> None:
    module, side = scheduler
    tokens = list(range(100, 116))
    hold(side, [], 0)
    side.matched(SimpleNamespace(request_id="r2", prompt_token_ids=tokens), 0)
    new = SimpleNamespace(req_id="r2", prompt_token_ids=tokens, block_ids=[[1, 2]], num_computed_tokens=0)
    first = side.build(step((new,), scheduled={"r2": 8}))
    assert first.loads == [] and first.saves == [module.Transfer("r2", tokens[:8], 0, 1, [[1, 2]])]
    cached = SimpleNamespace(req_ids=["r2"], new_block_ids=[[[3, 4]]], resumed_req_ids=set(), num_computed_tokens=[8])
    second = side.build(step(cached=cached, scheduled={"r2": 8}))
    assert second.saves == [module.Transfer("r2", tokens[:16], 1, 2, [[1, 2, 3, 4]])]
    assert side.build(step(cached=cached, scheduled={"r2": 0})).saves == []  # nothing new is complete


def test_without_a_cache_yet_nothing_is_held_and_a_producer_loads_nothing(scheduler: Any) -> None:
    _, side = scheduler
    tokens = list(range(200, 224))
    request = SimpleNamespace(request_id="r3", prompt_token_ids=tokens)
    assert side.matched(request, 0) == 0 and side.build(step()).counts == {"lookup_tokens": 24, "hit_tokens": 0}
    hold(side, tokens, 3)
    side.loads_kv = False  # kv_producer: looks up (to skip saving what is held), never loads
    assert side.matched(request, 0) == 0
    new = SimpleNamespace(req_id="r3", prompt_token_ids=tokens, block_ids=[list(range(6))], num_computed_tokens=0)
    assert side.build(step((new,), scheduled={"r3": 24})).saves == []  # every chunk is in the pool already
    assert side.finished("r3") is False


def test_a_sliding_window_layer_needs_only_the_chunks_inside_the_window_of_the_hit(scheduler: Any) -> None:
    """A full-attention group and a sliding-window group (window 4 tokens: 1 block of a chunk's 2): a hit needs the
    full layer's every chunk and the windowed layer's last chunk; vLLM waits for the whole-request load (several
    groups) and takes a request asked again (its load failed) without the pool."""
    module, _ = scheduler
    groups = KvGroups((PoolLayer("full", 0, 0), PoolLayer("window", 1, 1, window=4)), BLOCK, CHUNK)
    assert (groups.tail(groups.layers[0]), groups.tail(groups.layers[1])) == (2, 1)
    assert [groups.first_chunk(groups.layers[1], end) for end in (1, 2, 3)] == [0, 1, 2]
    side = module.SchedulerSide(ConnectorConfig(chunk_size=CHUNK), [IDENTITY], groups)
    assert side.async_loads
    tokens = list(range(300, 326))  # 3 full chunks and 2 tokens
    keys = chunk_keys(IDENTITY, tokens)
    # the windowed layer of chunk 0 was never saved (out of every window a later prefix needs), nor of chunk 2
    side.cache = FakeCache({layer_key(k, 0) for k in keys} | {layer_key(keys[1], 1)})
    request = SimpleNamespace(request_id="w1", prompt_token_ids=tokens)
    assert side.matched(request, 0) == 2 * CHUNK
    full, window = list(range(10, 17)), [0, 0, 0, 20, 21, 22, 23]  # vLLM's null block left of the window
    side.allocated(request, 2 * CHUNK, (full, window))
    meta = side.build(step())  # not scheduled: vLLM waits for the load
    assert meta.loads == [module.Transfer("w1", tokens[:16], 0, 2, [full[:4], window[:4]], whole_request=True)]
    assert meta.counts["miss_never_stored"] == 1
    new = SimpleNamespace(req_id="w1", prompt_token_ids=tokens, block_ids=[full, window], num_computed_tokens=16)
    assert side.build(step((new,), scheduled={"w1": 10})).saves == [
        module.Transfer("w1", tokens[:24], 2, 3, [full[:6], window[:6]])
    ]
    assert side.matched(request, 0) == 0  # asked again: the load failed, vLLM computes it all


def test_a_hinted_request_waits_for_its_prefetch_then_is_looked_up_as_any(scheduler: Any) -> None:
    """``kv_transfer_params={"kvpool": {"prefetch": true}}`` with the held prefix on the node's NVMe: vLLM is told to
    ask again (None) until the prefetch of the chunks it has not computed ended, then the lookup is answered and
    counted as without the hint.  Held in the node's DRAM, computed by vLLM already, or without the hint: at once;
    a malformed hint is counted and served as none."""
    _, side = scheduler
    tokens = list(range(400, 426))  # 3 full chunks and 2 tokens; the pool holds the first 2, on n1's NVMe
    objects = [layer_key(k, layer) for k in chunk_keys(IDENTITY, tokens)[:2] for layer in range(LAYERS)]
    side.cache = FakeCache(set(objects), tier=Tier.NVME)
    connection = FakeConnection()
    connection.client()  # the side's prefetch client, made: on n1
    side.prefetches = RequestPrefetches(connection, side.counts, wait_s=60.0)

    def request(req_id: str, params: Any = None) -> Any:
        return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, kv_transfer_params=params)

    hinted = request("h1", {"kvpool": {"prefetch": True}})
    assert side.matched(hinted, 0) is None and side.matched(hinted, 0) is None  # vLLM asks again later
    assert side.build(step()).counts == {"prefetch_started": 1}  # no lookup counted before it is answered
    connection.release.set()
    side.prefetches.close()  # the prefetch ended
    assert side.matched(hinted, 0) == 2 * CHUNK and connection.asked == [(objects, "", "")]
    assert side.build(step()).counts == {
        "prefetch_promoted": 2,  # FakeConnection's answer: 4 objects, 1 already there, 1 copied
        "prefetch_copied": 1,
        "lookup_tokens": 26,
        "hit_tokens": 16,
        "miss_never_stored": 1,
    }
    assert side.matched(request("h2", {"kvpool": {"prefetch": True}}), 2 * CHUNK) == 0  # vLLM has them: no prefetch
    assert side.matched(request("plain"), 0) == 2 * CHUNK
    assert side.matched(request("bad", {"kvpool": {"prefetch": 1}}), 0) == 2 * CHUNK
    side.cache = FakeCache(set(objects))  # in n1's DRAM
    assert side.matched(request("h3", {"kvpool": {"prefetch": True}}), 0) == 2 * CHUNK
    assert side.build(step()).counts["prefetch_bad_hint"] == 1 and len(connection.asked) == 1
    side.finished("h1")
    assert not side.prefetches.started("h1")
