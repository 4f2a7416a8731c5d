"""Rebuilding the pool's contents from chunk events, pure: a gap in the stream is an error, not a wrong picture;
the vLLM-shaped batches say the same as the events."""

import pytest

from kvpool.core.types import Tier
from kvpool.errors import MetadataUnavailable
from kvpool.metadata.events import ChunkEvent, EventKind, replay
from kvpool.metadata.zmq_events import AllBlocksCleared, BlockRemoved, BlockStored, vllm_batch

A, B = b"a" * 32, b"b" * 32


def test_replay_applies_stored_moved_removed_and_refuses_a_gap() -> None:
    held: dict[tuple[bytes, str], Tier | None] = {}
    replay(
        [
            ChunkEvent(EventKind.STORED, 5, A, "n1", Tier.DRAM, 10),
            ChunkEvent(EventKind.STORED, 5, B, "n1", Tier.DRAM, 10),
            ChunkEvent(EventKind.MOVED, 6, A, "n1", Tier.NVME, 10, was=Tier.DRAM),
            ChunkEvent(EventKind.REMOVED, 7, B, "n1", Tier.DRAM, 10),
        ],
        held,
    )
    assert held == {(A, "n1"): Tier.NVME}
    with pytest.raises(MetadataUnavailable, match="gap"):
        replay([ChunkEvent(EventKind.REMOVED, 8, B, "n1", Tier.DRAM)], held)
    with pytest.raises(MetadataUnavailable, match="gap"):
        replay([ChunkEvent(EventKind.MOVED, 8, A, "n2", Tier.DRAM, was=Tier.NVME)], held)


def test_a_move_is_a_removal_from_the_old_medium_then_a_store_in_the_new() -> None:
    batch = vllm_batch(
        [
            ChunkEvent(EventKind.MOVED, 6, A, "n1", Tier.NVME, 10, was=Tier.DRAM),
            ChunkEvent(EventKind.REMOVED, 7, B, "s3", Tier.REMOTE),
        ],
        cleared=True,
    )
    assert batch.events == [
        AllBlocksCleared(),
        BlockRemoved([A], "CPU", ownership="n1"),
        BlockStored([A], None, [], 0, None, "DISK", None, ownership="n1"),
        BlockRemoved([B], "STORAGE", ownership="s3"),
    ]
