"""ChunkStore with an encrypted NVMe tier — real segments, no Ray/etcd."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.clock import ManualClock
from kvpool.core.types import Tier
from kvpool.errors import CorruptChunk
from kvpool.pool.chunks import checksum
from kvpool.pool.config import Watermarks
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.segment import DramSegment, NvmeSegment
from kvpool.pool.tiers.codecs import TensorFormat
from kvpool.pool.tiers.crypto import KEY_BYTES, Keyring


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def segments(tmp_path: Path) -> Iterator[tuple[DramSegment, NvmeSegment]]:
    dram = DramSegment.create(1 << 20, "/dev/shm")
    nvme = NvmeSegment.create(1 << 20, str(tmp_path))
    yield dram, nvme
    dram.close()
    nvme.close()


def make(segments: tuple[DramSegment, NvmeSegment], codec: str, ring: Keyring | None) -> ChunkStore:
    return ChunkStore(
        *segments,
        watermarks=Watermarks(high=0.9, low=0.5),
        clock=ManualClock(),
        codecs={Tier.NVME: codec},
        keyring=ring,
    )


def nvme_file(segments: tuple[DramSegment, NvmeSegment]) -> bytes:
    with open(segments[1].path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("codec", ["raw", "fp8-e4m3+zstd"])
def test_every_chunk_on_nvme_is_sealed_and_comes_back(segments: tuple[DramSegment, NvmeSegment], codec: str) -> None:
    ring = Keyring({"k1": os.urandom(KEY_BYTES)})
    store = make(segments, codec, ring)
    plain = os.urandom(20_000)  # put as bytes: no tensor format
    t = torch.randn((32, 2, 2, 32), generator=torch.Generator().manual_seed(0))
    tensor = t.view(torch.uint8).numpy().tobytes()
    store.put(key(1), memoryview(plain), checksum(plain))
    store.put(key(2), memoryview(tensor), checksum(tensor), fmt=TensorFormat.of(t))
    down = [store.move(key(i), Tier.NVME) for i in (1, 2)]
    assert [c.codec for c in down] == ["raw+aes256gcm", f"{codec}+aes256gcm"]
    assert all(c.checksum == checksum(store.read(c.key)) for c in down)  # over the sealed bytes
    on_disk = nvme_file(segments)
    assert plain[:64] not in on_disk and tensor[:64] not in on_disk and tensor[-64:] not in on_disk
    up = store.moves.run(store.moves.promotions([key(1), key(2)]))  # promoted: opened (and decoded) back into raw DRAM
    assert [(c.tier, c.codec) for c in up] == [(Tier.DRAM, "raw")] * 2
    assert store.read(key(1)) == plain
    back = torch.frombuffer(bytearray(store.read(key(2))), dtype=torch.float32).view(t.shape)
    assert (back - t).abs().max() <= (0 if codec == "raw" else 0.07) * t.abs().max()
    assert store.audit() == []


def test_chunks_this_node_cannot_open_are_dropped_not_promoted(segments: tuple[DramSegment, NvmeSegment]) -> None:
    store = make(segments, "raw", Keyring({"k1": os.urandom(KEY_BYTES)}))
    plain = os.urandom(5000)
    store.put(key(1), memoryview(plain), checksum(plain))
    store.move(key(1), Tier.NVME)
    store.moves.keyring = Keyring({"k1": os.urandom(KEY_BYTES)})  # the key under that id replaced
    with pytest.raises(CorruptChunk):
        store.move(key(1), Tier.DRAM)
    assert key(1) not in store and store.counters["corrupt"] == 1 and store.audit() == []


def test_without_a_keyring_nvme_stays_as_it_was(segments: tuple[DramSegment, NvmeSegment]) -> None:
    store = make(segments, "raw", None)
    plain = os.urandom(5000)
    store.put(key(1), memoryview(plain), checksum(plain))
    assert store.move(key(1), Tier.NVME).codec == "raw" and plain in nvme_file(segments)
