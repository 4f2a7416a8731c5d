"""The one replica order (``kvpool.core.types.nearest_first``): local DRAM > local NVMe > peer DRAM > peer NVMe > S3."""

from kvpool.core.types import Placement, Tier, nearest_first

KEY = bytes(32)


def at(node: str, tier: Tier) -> Placement:
    return Placement(KEY, node, tier, offset=0, stored=1, size=1, checksum=0)


def test_replicas_are_tried_nearest_first() -> None:
    order = [at("me", Tier.DRAM), at("me", Tier.NVME), at("peer", Tier.DRAM), at("peer", Tier.NVME)]
    s3 = at("kvpool-remote", Tier.REMOTE)
    assert sorted([s3, *reversed(order)], key=nearest_first("me")) == [*order, s3]
    assert min([s3, order[3], order[2]], key=nearest_first("me")) == order[2]


def test_the_s3_tier_comes_last_even_under_a_name_like_this_nodes() -> None:
    s3 = at("me", Tier.REMOTE)
    assert sorted([s3, at("peer", Tier.NVME)], key=nearest_first("me"))[-1] == s3
