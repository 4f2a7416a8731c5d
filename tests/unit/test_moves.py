"""Moves between tiers in steps (pool/node/moves.py, pool/node/move_books.py): what happens when readers, removes or corruption
come between the steps that a ``PoolNode`` runs without its lock — real segments, no Ray/etcd."""

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpool.clock import ManualClock
from kvpool.core.types import Tier
from kvpool.errors import ChunkBusy
from kvpool.pool.chunks import ChangeKind, checksum
from kvpool.pool.config import Watermarks
from kvpool.pool.node.moves import load, write
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.segment import DramSegment, NvmeSegment
from kvpool.pool.tiers.codecs import TensorFormat

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int, n: int = BLOCK - 100) -> memoryview:  # not whole blocks: the copy pads to them
    return memoryview(np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes())


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    dram = DramSegment.create(16 * BLOCK, "/dev/shm")
    nvme = NvmeSegment.create(32 * BLOCK, str(tmp_path))
    yield ChunkStore(dram, nvme, watermarks=Watermarks(high=0.5, low=0.25), clock=ManualClock(), demote_inline=False)
    dram.close()
    nvme.close()


def put(store: ChunkStore, i: int) -> None:
    store.put(key(i), data(i), checksum(data(i)))


def test_a_move_in_steps_keeps_the_chunk_readable_and_the_books_whole(store: ChunkStore) -> None:
    put(store, 1)
    move = store.moves.begin(store.held(key(1)), Tier.NVME)
    assert store.audit() == []  # the room it moves to belongs to the move
    with pytest.raises(ChunkBusy):
        store.remove(key(1))
    with pytest.raises(ChunkBusy):
        store.moves.begin(store.held(key(1)), Tier.NVME)
    load(move, store.segments)
    store.moves.place(move)
    write(move, store.segments)
    assert store.read(key(1)) == data(1).tobytes()  # still served from DRAM until the move finishes
    moved = store.moves.finish(move)
    assert moved is not None and moved.tier is Tier.NVME
    assert store.read(key(1)) == data(1).tobytes() and store.audit() == []
    assert [c.kind for c in store.take_changes()] == [ChangeKind.ADDED, ChangeKind.MOVED]


def test_a_reader_that_pins_the_chunk_meanwhile_calls_the_move_off(store: ChunkStore) -> None:
    put(store, 1)
    move = store.moves.begin(store.held(key(1)), Tier.NVME)
    load(move, store.segments)
    store.moves.place(move)
    write(move, store.segments)
    reading = store.locate(key(1))  # a reader arrives before the finish
    assert store.moves.finish(move) == reading and reading.tier is Tier.DRAM
    store.release(key(1))
    assert store.usage()[Tier.NVME][0] == 0 and store.audit() == []
    assert store.counters["migrations"] == 0


def test_a_chunk_dropped_as_corrupt_meanwhile_is_gone_and_its_new_room_given_back(store: ChunkStore) -> None:
    put(store, 1)
    [move] = store.moves.moves_to([key(1)], Tier.NVME)[0]
    store.remove(key(1), corrupt=True)
    load(move, store.segments)
    store.moves.place(move)
    write(move, store.segments)
    assert store.moves.finish(move) is None
    assert key(1) not in store and store.usage() == {Tier.DRAM: (0, 16 * BLOCK), Tier.NVME: (0, 32 * BLOCK)}
    assert store.audit() == []


def test_corrupt_bytes_found_while_re_encoding_drop_the_chunk(tmp_path: Path) -> None:
    with DramSegment.create(1 << 20) as dram, NvmeSegment.create(1 << 20, str(tmp_path)) as nvme:
        store = ChunkStore(dram, nvme, codecs={Tier.NVME: "fp8-e4m3"}, demote_inline=False)
        t = torch.randn(64, 2, 4, 32)
        raw = memoryview(t.view(torch.uint8).numpy()).cast("B")
        chunk = store.put(key(1), raw, checksum(raw), fmt=TensorFormat.of(t))
        dram.write(chunk.offset + 10, b"\xff\xff")  # a flipped word in DRAM
        [moved] = store.moves.run([store.moves.begin(store.held(key(1)), Tier.NVME)])
        assert moved is None and key(1) not in store
        assert store.counters["corrupt"] == 1 and store.audit() == []


def test_demotions_run_in_threads_reach_the_low_watermark_with_every_byte_intact(store: ChunkStore) -> None:
    for i in range(9):  # 9 of 16 blocks > the high watermark (0.5): the commit flags it, moves nothing
        put(store, i)
    assert store.over_high.is_set() and store.counters["migrations"] == 0
    with ThreadPoolExecutor(4) as io:
        moved = store.moves.run(store.moves.demotions(), executor=io)
    assert [c.key for c in moved if c is not None] == [key(i) for i in range(5)]  # LRU first, down to 4/16
    assert store.usage()[Tier.DRAM][0] == 4 * BLOCK and store.moves.demotions() == []
    for i in range(9):
        assert store.read(key(i)) == data(i).tobytes()
    with ThreadPoolExecutor(4) as io:  # and back up, several at once
        up = store.moves.run(store.moves.promotions([key(i) for i in range(5)]), executor=io)
    assert all(c is not None and c.tier is Tier.DRAM for c in up) and store.audit() == []
    for i in range(9):
        assert store.read(key(i)) == data(i).tobytes()


def test_a_chunk_dropped_and_put_again_at_the_same_offset_meanwhile_is_left_alone(store: ChunkStore) -> None:
    put(store, 1)
    move = store.moves.begin(store.held(key(1)), Tier.NVME)
    store.remove(key(1), corrupt=True)
    again = store.put(key(1), data(1), checksum(data(1)))  # the freed room is the first fit: the same offset
    assert again.offset == move.chunk.offset
    load(move, store.segments)
    store.moves.place(move)
    write(move, store.segments)
    assert store.moves.finish(move) == again and again.tier is Tier.DRAM
    assert store.read(key(1)) == data(1).tobytes() and store.audit() == []
    store.remove(key(1))  # not pinned by the called-off move


def test_a_room_larger_than_the_free_space_demotes_lru_chunks_below_the_high_watermark(store: ChunkStore) -> None:
    """What ``PoolNode.open_room`` runs outside its lock: DRAM at 6/16 blocks (under its high watermark of 8) has no
    12 free blocks in a row, so LRU chunks go to NVMe until it would (counting where they are, not only how much),
    and the room then opens with nothing evicted under the lock."""
    for i in range(6):
        put(store, i)
    store.locate(key(3))  # recently read: the least recently used are 0, 1, 2, 4, 5
    store.release(key(3))
    # 10 free blocks in a row already
    assert store.moves.demotions() == [] and store.moves.demotions(need=10 * BLOCK) == []
    moves = store.moves.demotions(need=12 * BLOCK)
    # LRU order, until 12 blocks would be free in a row: [4, 16) once 4 and 5 go too; chunk 3, read lately, stays
    assert [m.chunk.key for m in moves] == [key(0), key(1), key(2), key(4), key(5)]
    store.moves.run(moves, threading.Lock(), None)
    migrated = store.counters["migrations"]
    room = store.open_room(12 * BLOCK, ttl_s=30.0)
    assert store.counters["drops"] == 0 and store.counters["migrations"] == migrated  # nothing more under the lock
    assert store.read(key(0)) == data(0).tobytes() and store.audit() == []
    store.close_room(room.id)
