"""What a prefetch into one node does with each key of a prompt's chunks: nothing, a promotion, a copy, or stop."""

import pytest

from kvpool.core.types import Placement, Tier
from kvpool.errors import NodeUnreachable
from kvpool.pool.client.prefetch import plan


def at(key: bytes, node: str, tier: Tier, identity: str = "fp") -> Placement:
    return Placement(key, node, tier, offset=0, stored=100, size=100, checksum=0, identity=identity)


def test_the_held_prefix_is_split_by_where_each_chunk_is() -> None:
    keys = [bytes([i]) * 32 for i in range(7)]
    replicas = [
        [at(keys[0], "b", Tier.DRAM), at(keys[0], "a", Tier.DRAM)],  # in b's DRAM already
        [at(keys[1], "b", Tier.NVME)],  # b's own NVMe: promoted there
        [at(keys[2], "a", Tier.DRAM, "fp1")],  # another node: copied
        [at(keys[3], "remote", Tier.REMOTE, "fp2")],  # only in S3: copied
        [at(keys[4], "a", Tier.NVME, "fp1"), at(keys[4], "b", Tier.NVME)],  # b's NVMe beats a's copy
        [],  # not held: a reader stops here, so does the prefetch
        [at(keys[6], "a", Tier.DRAM)],
    ]
    todo = plan(keys, replicas, "b", {"a", "b"})
    assert todo.already == 1 and todo.promote == [keys[1], keys[4]]
    assert todo.copy == {"fp1": [keys[2]], "fp2": [keys[3]]} and todo.not_held == 2 and todo.nbytes == 400


def test_nothing_held_and_an_unknown_node() -> None:
    keys = [b"k" * 32]
    assert plan(keys, [[]], "b", {"b"}).not_held == 1
    with pytest.raises(NodeUnreachable, match="no live pool node 'c' to prefetch into"):
        plan(keys, [[]], "c", {"a", "b"})
