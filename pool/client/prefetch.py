"""Prefetch: a prompt's prefix brought into one node's DRAM before a reader there asks for it.

A router that has chosen where a request goes knows which chunks the engine there will read; the ones held on that
node's NVMe, on another node or only in the S3 tier cost the engine a promotion, a one-sided read or a GET at the
moment it asks.  :meth:`PoolClient.prefetch <kvpool.pool.client.PoolClient.prefetch>` moves them first: what the node
holds on NVMe is promoted by the node itself (no byte leaves it), what it does not hold is read by the calling client
(nearest replica first, checksums verified) and put into the node's DRAM.  A later read there is a copy out of the
mapped segment.  Only the leading run of held chunks is worth moving — a reader stops at the first chunk the pool
does not hold — so the prefix ends there.
"""

from collections.abc import Collection, Sequence

import msgspec

from kvpool.core.types import Placement, Tier
from kvpool.errors import NodeUnreachable


class Prefetched(msgspec.Struct, frozen=True):
    """What a prefetch found and did, in chunks (``nbytes``: the bytes it promoted or copied)."""

    already: int  #: in the node's DRAM already
    promoted: int  #: moved from the node's own NVMe to its DRAM
    copied: int  #: read from another node or the S3 tier and put into the node's DRAM
    not_held: int  #: from the first key the pool does not hold on: nothing to prefetch
    nbytes: int


class Plan(msgspec.Struct, frozen=True):
    """Which keys of the held prefix need what, for a target node: its NVMe copies, and those it has none of."""

    already: int
    promote: list[bytes]
    copy: dict[str, list[bytes]]  #: by the cache identity their nearest replica was written under (the copy keeps it)
    not_held: int
    nbytes: int


def plan(keys: Sequence[bytes], replicas: Sequence[Sequence[Placement]], node: str, live: Collection[str]) -> Plan:
    """The plan for ``keys`` (``replicas[i]``: the placements of ``keys[i]``, nearest first) on ``node``, one of the
    ``live`` nodes (else ``NodeUnreachable``)."""
    if node not in live:
        raise NodeUnreachable(f"no live pool node {node[:12]!r} to prefetch into: pick one from kvpool status")
    already, nbytes = 0, 0
    promote: list[bytes] = []
    copy: dict[str, list[bytes]] = {}
    for i, (key, held) in enumerate(zip(keys, replicas, strict=True)):
        if not held:
            return Plan(already, promote, copy, len(keys) - i, nbytes)
        mine = {p.tier for p in held if p.node == node}
        if Tier.DRAM in mine:
            already += 1
        elif Tier.NVME in mine:
            promote.append(key)
            nbytes += held[0].size
        else:
            copy.setdefault(held[0].identity, []).append(key)
            nbytes += held[0].size
    return Plan(already, promote, copy, 0, nbytes)
