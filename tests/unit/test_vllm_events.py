"""The pool's chunks in vLLM's KV events: the hashes a save carries from the scheduler side to the workers, the
``BlockStored`` a worker builds once every layer of a save was put, the scheduler side publishing a chunk once every
writing rank reported it, and the removals and moves it reads from a fake watch cache.  Needs vLLM's event classes
(a skip where vLLM is optional and absent, as the engine tests)."""

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from engine_needed import vllm_module
from test_connector_core import FakeCache, placement

from kvpool.core.keys import CacheIdentity, chunk_keys, layer_key
from kvpool.core.types import Placement, Tier
from kvpool.prefill_decode.vllm.config import ConnectorConfig
from kvpool.prefill_decode.vllm.groups import KvGroups, PoolLayer

pytestmark = pytest.mark.slow  # imports vLLM (20-30 s on a busy box), once for the whole run

CHUNK, BLOCK, LAYERS = 8, 4, 2
IDENTITY = CacheIdentity(model="m", kv_dtype="float32", layout="vllm-test", chunk_size=CHUNK)
GROUPS = KvGroups(tuple(PoolLayer(f"layers.{i}", i, 0) for i in range(LAYERS)), BLOCK, CHUNK)
TOKENS = list(range(100, 120))  #: 2 full chunks (4 blocks) and 4 tokens (a 5th block)
RAW = [bytes([i]) * 32 for i in range(5)]  #: vLLM's hashes of the prompt's blocks, as a request holds them


class Cache(FakeCache):
    """A fake watch cache whose replicas have tiers."""

    def __init__(self) -> None:
        super().__init__(set())
        self.tiers: dict[bytes, Tier] = {}

    def hold(self, key: bytes, tier: Tier | None) -> None:
        if tier is None:
            self.tiers.pop(key, None)
            self.held.discard(key)
        else:
            self.tiers[key] = tier
            self.held.add(key)

    def replicas(self, key: bytes) -> list[Placement]:
        return [placement(key, tier=self.tiers[key])] if key in self.tiers else []


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sides(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A scheduler side with events on (2 writing ranks), its events, and a worker side's saved-chunk tracker."""
    events = vllm_module("kvpool.prefill_decode.vllm.events")
    scheduler = vllm_module("kvpool.prefill_decode.vllm.scheduler")
    monkeypatch.setattr(scheduler.SchedulerSide, "_connect", lambda self: None)  # no etcd
    clock = Clock()
    pool_events = events.PoolEvents(GROUPS, BLOCK, writers=2, clock=clock)
    side = scheduler.SchedulerSide(ConnectorConfig(chunk_size=CHUNK), [IDENTITY], GROUPS, events=pool_events)
    side.cache = Cache()
    return events, side, pool_events, clock


def save_of(side: Any) -> Any:
    """The save the scheduler side plans for a fresh request of ``TOKENS`` computed in one step."""
    request = SimpleNamespace(request_id="r", prompt_token_ids=TOKENS, block_hashes=RAW)
    assert side.matched(request, 0) == 0
    new = SimpleNamespace(req_id="r", prompt_token_ids=TOKENS, block_ids=[[7, 8, 9, 10, 11]], num_computed_tokens=0)
    step = SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={"r": len(TOKENS)},
    )
    [save] = side.build(step).saves
    return save


def reported(events: Any, save: Any, ok: bool = True) -> list[Any]:
    """What one worker reports after putting every layer of ``save`` (``ok``: the pool took them)."""
    saved = events.SavedChunks(GROUPS)
    for _ in range(LAYERS):
        saved.queued(save)
    saved.put([save], ok)
    assert saved.take() is None  # nothing until the last layer's put
    saved.put([save], ok)
    taken = saved.take()
    return taken.get_all_events() if taken is not None else []


def test_a_save_becomes_one_block_stored_per_chunk_with_vllms_hashes_and_the_dram_medium(sides: Any) -> None:
    events, side, _, _ = sides
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    save = save_of(side)
    hashes = [maybe_convert_block_hash(h) for h in RAW[:4]]
    assert (save.first, save.end, save.hashes) == (0, 2, hashes)
    first, second = reported(events, save)
    assert first.block_hashes == hashes[:2] and first.parent_block_hash is None
    assert second.block_hashes == hashes[2:] and second.parent_block_hash == hashes[1]
    assert first.token_ids == TOKENS[:CHUNK] and second.token_ids == TOKENS[CHUNK : 2 * CHUNK]
    assert (second.block_size, second.medium, second.ownership, second.group_idx) == (BLOCK, "CPU", "kvpool", 0)
    # vLLM's publisher and a router decode them as vLLM's own
    from vllm.distributed.kv_events import KVEventBatch

    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[second])), type=KVEventBatch)
    assert batch.events == [second]


def test_a_failed_put_reports_nothing_and_events_off_carry_no_hashes(sides: Any) -> None:
    events, side, _, _ = sides
    assert reported(events, save_of(side), ok=False) == []
    side.events = None
    assert save_of(side).hashes == []


def test_a_chunk_is_published_once_every_writer_reported_it_then_its_moves_and_its_removal(sides: Any) -> None:
    events, side, pool_events, clock = sides
    cache = side.cache
    save = save_of(side)
    first, second = reported(events, save)
    pool_events.confirm([first, second])  # rank 0's reports
    assert pool_events.take(cache) == []
    pool_events.confirm([second, first])  # rank 1's, in another order
    assert pool_events.take(cache) == [second, first]

    watched = [layer_key(k, 0) for k in chunk_keys(IDENTITY, TOKENS[: 2 * CHUNK])]
    cache.hold(watched[0], Tier.DRAM)
    cache.hold(watched[1], Tier.DRAM)
    clock.now += 2
    assert pool_events.take(cache) == []  # held where it was said to be
    cache.hold(watched[1], Tier.NVME)  # demoted
    clock.now += 0.5
    assert pool_events.take(cache) == []  # looked at once a second at most
    clock.now += 0.5
    removed, stored = pool_events.take(cache)
    assert (type(removed).__name__, removed.block_hashes, removed.medium) == (
        "BlockRemoved",
        second.block_hashes,
        "CPU",
    )
    assert stored == msgspec.structs.replace(second, medium="DISK")
    cache.hold(watched[0], None)  # evicted
    clock.now += 1
    [gone] = pool_events.take(cache)
    assert (type(gone).__name__, gone.block_hashes, gone.medium, gone.ownership) == (
        "BlockRemoved",
        first.block_hashes,
        "CPU",
        "kvpool",
    )


def test_a_chunk_the_watch_never_showed_is_taken_as_removed_only_after_a_while(sides: Any) -> None:
    events, side, pool_events, clock = sides
    cache = side.cache
    first, second = reported(events, save_of(side))
    pool_events.confirm([first, second, first, second])
    assert len(pool_events.take(cache)) == 2
    clock.now += events.UNSEEN_S / 2
    assert pool_events.take(cache) == []  # the watch has not shown these chunks yet
    clock.now += events.UNSEEN_S
    assert [e.block_hashes for e in pool_events.take(cache)] == [first.block_hashes, second.block_hashes]
