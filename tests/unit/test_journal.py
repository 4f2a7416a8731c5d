"""The NVMe journal (warm restart): what a store did to its NVMe tier, replayed by the next node on the same
segment; only chunks whose bytes verify are taken back.  Real segment files and a real ChunkStore; no Ray, no etcd."""

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvpool.core.types import DropCause, Tier
from kvpool.errors import SetupError
from kvpool.pool.chunks import ChangeKind, checksum
from kvpool.pool.node import journal as journal_module
from kvpool.pool.node.journal import NvmeJournal, segment_name, take_back
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.segment import DramSegment, NvmeSegment

BLOCK = 64 * 1024
NVME = 16 * BLOCK
NAME = segment_name("test", "127.0.0.9")


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int) -> memoryview:
    return memoryview(np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes())


@pytest.fixture
def io() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as pool:
        yield pool


class Node:
    """What a PoolNode does with a journal, without Ray: open, take back, record every change, close."""

    def __init__(self, directory: Path, io: ThreadPoolExecutor, capacity: int = NVME) -> None:
        self.dram = DramSegment.create(8 * BLOCK, "/dev/shm")
        self.nvme, self.journal, named = NvmeJournal.open(str(directory), NAME, capacity)
        self.store = ChunkStore(self.dram, self.nvme)
        self.recovery = take_back(self.store, self.journal, self.nvme, named, io)
        self.changes = self.store.take_changes()

    def put_on_nvme(self, ids: range) -> None:
        for i in ids:
            self.store.put(key(i), data(i), checksum(data(i)))
            self.store.move(key(i), Tier.NVME)
        self.journal.record(self.store.take_changes())

    def stop(self) -> None:
        self.journal.close()
        self.nvme.close()
        self.dram.close()


def test_a_restarted_node_takes_back_every_nvme_chunk_and_nothing_else(tmp_path: Path, io: ThreadPoolExecutor) -> None:
    first = Node(tmp_path, io)
    assert first.recovery.adopted == [] and first.changes == []
    first.put_on_nvme(range(6))
    first.store.put(key(100), data(100), checksum(data(100)))  # stays in DRAM: lost with the node, not journaled
    first.store.remove(key(1))
    first.store.move(key(2), Tier.DRAM)  # promoted off NVMe: its NVMe copy is gone
    first.journal.record(first.store.take_changes())
    first.stop()

    second = Node(tmp_path, io)
    adopted = {c.key for c in second.recovery.adopted}
    assert adopted == {key(i) for i in (0, 3, 4, 5)} and second.recovery.dropped == []
    assert all(c.kind is ChangeKind.ADDED and c.chunk.tier is Tier.NVME for c in second.changes)
    assert second.store.audit() == []
    for i in (0, 3, 4, 5):
        assert second.store.read(key(i)) == data(i).tobytes()
    second.put_on_nvme(range(10, 12))  # the new node goes on where the last one left off, without overlap
    assert second.store.audit() == []
    second.stop()
    third = Node(tmp_path, io)
    assert {c.key for c in third.recovery.adopted} == adopted | {key(10), key(11)}
    third.stop()


def test_a_flipped_byte_is_dropped_as_corrupt_never_served(tmp_path: Path, io: ThreadPoolExecutor) -> None:
    first = Node(tmp_path, io)
    first.put_on_nvme(range(4))
    victim = first.store.locate(key(2))
    first.store.release(key(2))
    first.stop()
    with open(tmp_path / f"kvpool-{NAME}.nvme", "r+b") as f:
        f.seek(victim.offset + 1000)
        byte = f.read(1)
        f.seek(victim.offset + 1000)
        f.write(bytes([byte[0] ^ 0x01]))

    second = Node(tmp_path, io)
    assert {c.key for c in second.recovery.adopted} == {key(0), key(1), key(3)}
    assert [c.key for c in second.recovery.dropped] == [key(2)]
    dropped = [c for c in second.changes if c.kind is ChangeKind.DROPPED]
    assert [(c.chunk.key, c.cause) for c in dropped] == [(key(2), DropCause.CORRUPT)]  # its tombstone says why
    assert key(2) not in second.store
    second.stop()


def test_newer_record_wins_a_range_and_a_torn_tail_ends_the_replay(tmp_path: Path, io: ThreadPoolExecutor) -> None:
    first = Node(tmp_path, io)
    first.put_on_nvme(range(2))
    old = first.store.locate(key(0))
    first.store.release(key(0))
    first.store.remove(key(0))
    first.store.take_changes()  # the "gone" of key 0 never reaches the journal (a crash before it was written)
    first.put_on_nvme(range(5, 6))  # lands where key 0 was
    assert first.store.locate(key(5)).offset == old.offset
    first.stop()
    with open(tmp_path / f"kvpool-{NAME}.journal", "ab") as f:
        f.write(b"\x40\x00\x00\x00torn")  # a record cut short by a crash mid-append

    second = Node(tmp_path, io)
    assert {c.key for c in second.recovery.adopted} == {key(1), key(5)}
    assert [c.key for c in second.recovery.dropped] == [key(0)]
    assert second.store.read(key(5)) == data(5).tobytes()
    second.stop()


def test_another_capacity_starts_a_fresh_segment(tmp_path: Path, io: ThreadPoolExecutor) -> None:
    first = Node(tmp_path, io)
    first.put_on_nvme(range(3))
    first.stop()
    second = Node(tmp_path, io, capacity=2 * NVME)
    assert second.recovery.adopted == [] and second.nvme.capacity == 2 * NVME
    assert os.path.getsize(second.nvme.path) == 2 * NVME
    second.stop()


def test_two_nodes_cannot_share_a_segment(
    tmp_path: Path, io: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "LOCK_WAIT_S", 0.2)
    first = Node(tmp_path, io)
    with pytest.raises(SetupError, match=f"pid {os.getpid()}.*own --nvme-dir"):
        NvmeJournal.open(str(tmp_path), NAME, NVME)
    first.stop()
    Node(tmp_path, io).stop()  # free again once the first has stopped


def test_the_journal_is_compacted_as_it_grows(
    tmp_path: Path, io: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "COMPACT_MIN", 16)
    node = Node(tmp_path, io)
    for turn in range(20):  # each turn: 2 chunks come to NVMe and go again (4 records)
        node.put_on_nvme(range(turn * 2, turn * 2 + 2))
        for i in range(turn * 2, turn * 2 + 2):
            node.store.remove(key(i))
        node.journal.record(node.store.take_changes())
    node.put_on_nvme(range(500, 503))
    records = node.journal._records
    node.stop()
    assert records <= 16  # rewritten with what stands whenever it passed the bound, not 83 records
    again = Node(tmp_path, io)
    assert {c.key for c in again.recovery.adopted} == {key(500), key(501), key(502)}
    again.stop()


def test_a_journal_that_cannot_be_written_stops_and_the_next_start_is_empty(
    tmp_path: Path, io: ThreadPoolExecutor
) -> None:
    node = Node(tmp_path, io)
    node.put_on_nvme(range(2))
    assert node.journal._fd is not None
    os.close(node.journal._fd)  # the disk under the journal fails
    node.put_on_nvme(range(2, 4))  # no exception: the changes still go on to etcd
    assert node.journal._fd is None and not os.path.exists(node.journal.path)
    node.put_on_nvme(range(4, 5))  # nothing more is written
    node.stop()
    again = Node(tmp_path, io)
    assert again.recovery.adopted == []
    again.stop()


def test_an_unknown_journal_is_not_trusted(tmp_path: Path, io: ThreadPoolExecutor) -> None:
    (tmp_path / f"kvpool-{NAME}.journal").write_bytes(b"not a journal at all")
    NvmeSegment.create(NVME, str(tmp_path), name=NAME).close(remove=False)
    node = Node(tmp_path, io)
    assert node.recovery.adopted == []
    node.stop()
