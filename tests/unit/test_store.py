"""ChunkStore: allocation with eviction, watermark migration, pins, promotion — real segments, no Ray/etcd."""

from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvpool.clock import ManualClock
from kvpool.core.types import Tier
from kvpool.errors import ChunkBusy, ChunkNotFound, ConfigError, PoolFull
from kvpool.pool.chunks import ChangeKind, ChunkState
from kvpool.pool.config import Watermarks
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.segment import DramSegment, NvmeSegment

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int, n: int = BLOCK) -> memoryview:
    return memoryview(np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes())


@pytest.fixture
def segments(tmp_path: Path) -> Iterator[tuple[DramSegment, NvmeSegment]]:
    dram = DramSegment.create(10 * BLOCK, "/dev/shm")
    nvme = NvmeSegment.create(20 * BLOCK, str(tmp_path))
    yield dram, nvme
    dram.close()
    nvme.close()


def make(segments: tuple[DramSegment, NvmeSegment], clock: ManualClock, **kw: object) -> ChunkStore:
    dram, nvme = segments
    return ChunkStore(dram, nvme, watermarks=Watermarks(high=0.8, low=0.5), clock=clock, **kw)  # type: ignore[arg-type]


def put_n(store: ChunkStore, clock: ManualClock, ids: range) -> None:
    for i in ids:
        store.put(key(i), data(i), checksum=i)
        clock.advance(1)


def test_put_read_and_changes(segments: tuple[DramSegment, NvmeSegment]) -> None:
    clock = ManualClock()
    store = make(segments, clock)
    chunk = store.put(key(1), data(1), checksum=11)
    assert chunk.tier is Tier.DRAM and chunk.checksum == 11
    assert store.read(key(1)) == data(1).tobytes()
    assert [c.kind for c in store.take_changes()] == [ChangeKind.ADDED]
    assert store.take_changes() == []
    assert store.put(key(1), data(1), checksum=11) == chunk  # keys name content: no second copy
    assert store.usage()[Tier.DRAM][0] == BLOCK


def test_dram_above_high_watermark_migrates_lru_to_nvme(segments: tuple[DramSegment, NvmeSegment]) -> None:
    clock = ManualClock()
    store = make(segments, clock)
    put_n(store, clock, range(8))  # 8 of 10 blocks: at the high watermark, not above
    assert store.counters["migrations"] == 0
    store.locate(key(0))  # chunk 0 becomes the most recently used
    store.release(key(0))
    store.take_changes()
    put_n(store, clock, range(8, 9))  # 9/10 > 0.8: migrate LRU until <= 0.5
    moved = [c.chunk.key for c in store.take_changes() if c.kind is ChangeKind.MOVED]
    assert moved == [key(1), key(2), key(3), key(4)]
    assert store.usage()[Tier.DRAM][0] == 5 * BLOCK
    for i in range(9):  # every byte intact, wherever it lives
        assert store.read(key(i)) == data(i).tobytes()
    assert {c.key for c in store.chunks() if c.tier is Tier.NVME} == set(moved)


def test_pinned_chunks_are_never_moved(segments: tuple[DramSegment, NvmeSegment]) -> None:
    clock = ManualClock()
    store = make(segments, clock)
    put_n(store, clock, range(8))
    for i in range(4):
        store.locate(key(i))  # readers in flight on the four LRU chunks
    put_n(store, clock, range(8, 9))
    assert all(store.locate(key(i)).tier is Tier.DRAM for i in range(4))
    assert {c.key for c in store.chunks() if c.tier is Tier.NVME} == {key(4), key(5), key(6), key(7)}


def test_hit_on_nvme_is_promoted(segments: tuple[DramSegment, NvmeSegment]) -> None:
    """As ``PoolNode.prepare_load`` does it: promotions of a reader's hits first, then the pins where they are."""
    clock = ManualClock()
    store = make(segments, clock)
    put_n(store, clock, range(9))
    assert store.locate(key(1)).tier is Tier.NVME  # a pin alone moves nothing
    store.release(key(1))
    store.moves.run(store.moves.promotions([key(1)]))
    assert store.locate(key(1)).tier is Tier.DRAM  # was on NVMe
    store.release(key(1))
    assert store.counters["promotions"] == 1
    assert store.read(key(1)) == data(1).tobytes()


def test_full_pool_with_everything_pinned_is_pool_full(segments: tuple[DramSegment, NvmeSegment]) -> None:
    dram, _ = segments
    clock = ManualClock()
    store = ChunkStore(dram, None, clock=clock)  # no NVMe: a full DRAM drops LRU chunks
    put_n(store, clock, range(10))
    put_n(store, clock, range(10, 11))
    assert key(0) not in store and key(10) in store
    assert store.counters["drops"] == 1
    for i in range(1, 11):
        store.locate(key(i))
    with pytest.raises(PoolFull, match="pinned"):
        store.put(key(99), data(99), checksum=0)
    assert key(99) not in store  # nothing half-written


def test_too_large_for_any_segment(segments: tuple[DramSegment, NvmeSegment]) -> None:
    store = make(segments, ManualClock())
    with pytest.raises(PoolFull, match=r"larger than this node's dram segment"):
        store.put(key(1), data(1, 11 * BLOCK), checksum=0)


def test_nvme_full_drops_replicated_chunks_first(tmp_path: Path) -> None:
    clock = ManualClock()
    with DramSegment.create(4 * BLOCK) as dram, NvmeSegment.create(4 * BLOCK, str(tmp_path)) as nvme:
        store = ChunkStore(dram, nvme, watermarks=Watermarks(high=0.5, low=0.25), clock=clock)
        for i in range(8):
            store.put(key(i), data(i), checksum=i, replicated=i in (1, 3))
            clock.advance(1)
        dropped = [c.chunk.key for c in store.take_changes() if c.kind is ChangeKind.DROPPED]
        assert dropped[:2] == [key(1), key(3)]  # copies elsewhere go first, then LRU
        assert key(7) in store


def test_unknown_key_and_remove(segments: tuple[DramSegment, NvmeSegment]) -> None:
    store = make(segments, ManualClock())
    with pytest.raises(ChunkNotFound):
        store.locate(key(5))
    store.put(key(5), data(5), checksum=5)
    store.locate(key(5))
    with pytest.raises(ChunkBusy, match="being read"):
        store.remove(key(5))
    assert store.counters["busy"] == 1
    store.release(key(5))
    store.remove(key(5))
    assert key(5) not in store and store.usage()[Tier.DRAM][0] == 0


def test_a_room_filled_with_a_batch_holds_its_chunks_and_frees_the_rest(
    segments: tuple[DramSegment, NvmeSegment],
) -> None:
    dram, _ = segments
    clock = ManualClock()
    store = make(segments, clock)
    store.put(key(9), data(9), checksum=9)
    room = store.open_room(4 * BLOCK, ttl_s=30.0)
    offsets = room.carve([BLOCK, 100, BLOCK])
    assert offsets is not None and room.carve([4 * BLOCK, 1]) is None
    for i, (offset, n) in enumerate(zip(offsets, [BLOCK, 100, BLOCK], strict=True)):
        dram.write(offset, data(i, n))  # as a writer fills it, keys unknown to the node until now
    assert store.usage()[Tier.DRAM][0] == 5 * BLOCK and store.audit() == []
    store.take_changes()
    store.fill_room(
        room.id,
        [
            (key(0), offsets[0], BLOCK, 0, None),
            (key(1), offsets[1], 100, 1, None),
            (key(9), offsets[2], BLOCK, 9, None),
        ],
    )
    assert [c.chunk.key for c in store.take_changes()] == [key(0), key(1)]  # key 9 keeps its first copy
    assert store.read(key(1)) == data(1, 100).tobytes() and store.read(key(9)) == data(9).tobytes()
    assert store.usage()[Tier.DRAM][0] == 2 * BLOCK + 4096 and store.audit() == []
    with pytest.raises(ChunkNotFound, match="put the batch again"):
        store.fill_room(room.id, [])  # a room is filled once


def test_a_room_refuses_chunks_outside_it_or_overlapping_and_keeps_nothing(
    segments: tuple[DramSegment, NvmeSegment],
) -> None:
    store = make(segments, ManualClock())
    for bad in (
        lambda r: [(key(1), r.offset + r.length - 4096, BLOCK, 1, None)],  # past its end
        lambda r: [(key(1), r.offset + 100, 10, 1, None)],  # not on a block boundary
        lambda r: [(key(1), r.offset, BLOCK, 1, None), (key(2), r.offset + 4096, 10, 2, None)],  # overlapping
        lambda r: [(b"short", r.offset, 10, 1, None)],
        lambda r: [(key(1), r.offset, 10, -1, None)],
        lambda r: [(key(1), r.offset, 10)],  # no format
        lambda r: [(key(1), r.offset, True, 1, None)],
    ):
        room = store.open_room(2 * BLOCK, ttl_s=30.0)
        with pytest.raises(ConfigError):
            store.fill_room(room.id, bad(room))  # type: ignore[arg-type]
        assert key(1) not in store and store.usage()[Tier.DRAM][0] == 0 and store.audit() == []


def test_rooms_left_idle_are_reaped_after_their_own_ttl(segments: tuple[DramSegment, NvmeSegment]) -> None:
    clock = ManualClock()
    store = make(segments, clock)
    short_lived, long_lived = store.open_room(BLOCK, ttl_s=5.0), store.open_room(BLOCK, ttl_s=60.0)
    clock.advance(6)
    assert store.reap() == 1 and store.usage()[Tier.DRAM][0] == BLOCK
    with pytest.raises(ChunkNotFound):
        store.fill_room(short_lived.id, [])
    store.fill_room(long_lived.id, [])
    assert store.usage()[Tier.DRAM][0] == 0 and store.audit() == []


def test_move_demotes_and_promotes_on_request(segments: tuple[DramSegment, NvmeSegment]) -> None:
    clock = ManualClock()
    store = make(segments, clock)
    put_n(store, clock, range(2))
    store.take_changes()
    moved = store.move(key(0), Tier.NVME)
    assert moved.tier is Tier.NVME and store.read(key(0)) == bytes(data(0))
    assert [c.kind for c in store.take_changes()] == [ChangeKind.MOVED]
    assert store.move(key(0), Tier.NVME) is moved  # already there: nothing to do
    store.locate(key(1))
    with pytest.raises(ChunkBusy, match="being read"):
        store.move(key(1), Tier.NVME)
    assert store.move(key(0), Tier.DRAM).tier is Tier.DRAM
    with pytest.raises(ChunkNotFound):
        store.move(key(9), Tier.NVME)


def test_a_chunk_state_is_what_the_audit_says(segments: tuple[DramSegment, NvmeSegment]) -> None:
    store = make(segments, ManualClock())
    store.put(key(1), data(1), checksum=1)
    assert store.state(key(1)) is ChunkState.STORED
    store.locate(key(1))
    assert store.state(key(1)) is ChunkState.PINNED
    store.release(key(1))
    move = store.moves.begin(store.held(key(1)), Tier.NVME)
    store.moves.place(move)
    assert store.state(key(1)) is ChunkState.MOVING and store.audit() == []
    room = store.open_room(BLOCK, ttl_s=30.0)
    at = store.chunks()[0].offset
    store.holds._rooms[room.id] = msgspec.structs.replace(room, offset=at)  # a room over a stored chunk's extent
    store.allocators[Tier.DRAM].free(room.offset)
    assert f"dram: a pinned and a room share offset {at}" in store.audit()  # a move pins its chunk
