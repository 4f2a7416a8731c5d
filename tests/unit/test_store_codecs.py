"""ChunkStore with a codec per tier, and its remote-tier bookkeeping — real segments, no Ray/etcd."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.clock import ManualClock
from kvpool.core.types import Tier
from kvpool.errors import ConfigError
from kvpool.pool.chunks import ChangeKind, checksum
from kvpool.pool.config import Watermarks
from kvpool.pool.node.flush import idle
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.segment import DramSegment, NvmeSegment
from kvpool.pool.tiers.codecs import TensorFormat

SHAPE = (64, 2, 4, 32)  # [tokens, K/V, heads, head dim]: 64 KiB of float32


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def kv(i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(dtype)


def raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


@pytest.fixture
def segments(tmp_path: Path) -> Iterator[tuple[DramSegment, NvmeSegment]]:
    dram = DramSegment.create(1 << 20, "/dev/shm")
    nvme = NvmeSegment.create(1 << 20, str(tmp_path))
    yield dram, nvme
    dram.close()
    nvme.close()


def make(segments: tuple[DramSegment, NvmeSegment], nvme_codec: str, clock: ManualClock | None = None) -> ChunkStore:
    return ChunkStore(
        *segments,
        watermarks=Watermarks(high=0.9, low=0.5),
        clock=clock or ManualClock(),
        codecs={Tier.NVME: nvme_codec},
    )


def put_tensor(store: ChunkStore, i: int, t: torch.Tensor) -> None:
    data = raw(t)
    store.put(key(i), data, checksum(data), fmt=TensorFormat.of(t))


@pytest.mark.parametrize(("codec", "tolerance", "smaller"), [("fp8-e4m3", 0.07, 3.5), ("int4+zstd", 0.3, 5.0)])
def test_a_chunk_is_encoded_going_down_and_decoded_coming_back(
    segments: tuple[DramSegment, NvmeSegment], codec: str, tolerance: float, smaller: float
) -> None:
    store = make(segments, codec)
    t = kv(1)
    put_tensor(store, 1, t)
    store.take_changes()
    down = store.move(key(1), Tier.NVME)
    assert down.codec == codec and down.stored < t.nbytes / smaller and down.size == t.nbytes
    assert down.checksum == checksum(store.read(key(1)))  # the checksum is of the stored (encoded) bytes
    assert [(c.kind, c.chunk.codec) for c in store.take_changes()] == [(ChangeKind.MOVED, codec)]
    store.moves.run(store.moves.promotions([key(1)]))  # promote on hit: decoded back into DRAM, raw
    up = store.locate(key(1))
    store.release(key(1))
    assert up.tier is Tier.DRAM and up.codec == "raw" and up.stored == t.nbytes
    back = TensorFormat.of(t)
    assert back is not None
    got = back.view(store.read(key(1)))
    assert up.checksum == checksum(store.read(key(1)))
    assert (got - t).abs().max() <= tolerance * t.abs().max()
    assert store.counters["encoded"] == 1 and store.counters["decoded"] == 1


def test_chunks_put_as_bytes_or_unencodable_stay_raw(segments: tuple[DramSegment, NvmeSegment]) -> None:
    store = make(segments, "fp8-e4m3")
    data = raw(kv(2))
    store.put(key(2), data, checksum(data))  # no format: the codec cannot know the dtype
    nan = kv(3)
    nan[0, 0, 0, 0] = float("nan")  # a quantizer refuses NaN: kept raw rather than lost
    put_tensor(store, 3, nan)
    for i in (2, 3):
        moved = store.move(key(i), Tier.NVME)
        assert moved.codec == "raw" and moved.stored == data.nbytes
    assert store.counters["encoded"] == 0


def test_a_corrupt_chunk_is_dropped_not_reencoded(segments: tuple[DramSegment, NvmeSegment]) -> None:
    """Re-encoding would give corrupt values a valid new checksum: the stored bytes are checked first."""
    store = make(segments, "int4")
    put_tensor(store, 4, kv(4))
    chunk = store.move(key(4), Tier.NVME)
    store.take_changes()
    flipped = bytearray(store.read(key(4)))
    flipped[100] ^= 0xFF
    store.segments[Tier.NVME].write(chunk.offset, flipped)
    assert store.moves.run(store.moves.promotions([key(4)])) == [None]  # a promotion finds it corrupt
    assert key(4) not in store and store.counters["corrupt"] == 1
    assert [c.kind for c in store.take_changes()] == [ChangeKind.DROPPED]
    assert store.usage()[Tier.NVME][0] == 0


def test_codec_config_is_checked(segments: tuple[DramSegment, NvmeSegment]) -> None:
    with pytest.raises(ConfigError, match="DRAM tier stores chunks raw"):
        ChunkStore(*segments, codecs={Tier.DRAM: "fp8-e4m3"})
    with pytest.raises(ConfigError, match="unknown codec"):
        ChunkStore(*segments, codecs={Tier.NVME: "fp7"})
    store = make(segments, "raw")
    with pytest.raises(ConfigError, match="its format"):
        store.put(key(5), memoryview(bytes(1000)), 0, fmt=TensorFormat("float32", (10,)))
    assert store.usage()[Tier.DRAM][0] == 0  # the room was given back


def test_idle_chunks_for_the_remote_tier_and_their_drop_order(segments: tuple[DramSegment, NvmeSegment]) -> None:
    clock = ManualClock()
    store = make(segments, "raw", clock)
    for i in range(4):
        put_tensor(store, i, kv(i))
        store.move(key(i), Tier.NVME)
        clock.advance(10)
    # last accesses at 0, 10, 20, 30; now 40
    assert [c.key for c in idle(store, Tier.NVME, 25, 1 << 30)] == [key(0), key(1)]
    assert [c.key for c in idle(store, Tier.NVME, 0, 100_000)] == [key(0)]  # bounded, but at least one
    store.mark_in_remote([key(1), key(9)])  # a key no longer held is skipped
    assert [c.key for c in idle(store, Tier.NVME, 25, 1 << 30)] == [key(0)]
    assert next(store.policy.drop_order(Tier.NVME)) == key(1)  # a full NVMe drops what is remote first
