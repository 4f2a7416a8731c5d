"""The write path: a batch's bytes into one node, between a reservation and a commit (or an abort).

Same node: the client writes straight into the node's mapped DRAM segment.  A peer: the bytes go through the
client's registered staging buffer and one batched one-sided WRITE per round.  Either way in rounds, since room
reserved but not yet committed cannot be evicted to make more: at most a quarter of the holder's DRAM (and of
the staging buffer) is reserved at once.  Keys name content: a key the holder has already is not written again.
"""

from collections.abc import Sequence
from typing import Any

from kvpool.pool.chunks import SEGMENT_NAMES, Reservation
from kvpool.pool.node_handle import call
from kvpool.pool.peers import STAGING_BYTES, Peers, rounds
from kvpool.pool.segment import DramSegment
from kvpool.pool.tiers.codecs import TensorFormat
from kvpool.pool.types import Tier
from kvpool.transport.base import Op

Item = tuple[bytes, memoryview]  #: a chunk to write: its key and its bytes
Summary = tuple[int, TensorFormat | None]  #: what a commit says of a chunk: its checksum and its tensor format


def put_local(node: Any, segment: DramSegment, items: Sequence[Item], sums: Sequence[Summary], replicated: bool) -> int:
    """Write ``items`` into this node (``node``: its actor, ``segment``: its mapped DRAM); the etcd revision
    that shows them."""
    revision = 0
    for r in rounds([v.nbytes for _, v in items], max(1, segment.capacity // 4)):
        reservations: list[Reservation] = call(node.reserve_batch.remote([(k, v.nbytes) for k, v in items[r]]))
        fresh = [(res, v, s) for res, (_, v), s in zip(reservations, items[r], sums[r], strict=True)]
        fresh = [f for f in fresh if not f[0].already_stored]
        try:
            for res, view, _ in fresh:
                segment.write(res.offset, view)
        except BaseException:
            call(node.abort_batch.remote([res.key for res, _, _ in fresh]))
            raise
        revision = max(
            revision, int(call(node.commit_batch.remote([(res.key, *s) for res, _, s in fresh], replicated)))
        )
    return revision


def put_peer(
    node: Any, peers: Peers, node_id: str, dram_bytes: int, items: Sequence[Item], sums: Sequence[Summary],
    replicated: bool,
) -> int:  # fmt: skip
    """Write ``items`` into the peer ``node_id`` (``node``: its actor, ``dram_bytes``: its DRAM capacity) from
    the staging buffer; the etcd revision that shows them."""
    revision = 0
    for r in rounds([v.nbytes for _, v in items], min(max(dram_bytes // 4, 1), STAGING_BYTES)):
        staging = peers.staging(sum(v.nbytes for _, v in items[r]))
        reservations: list[Reservation] = call(node.reserve_batch.remote([(k, v.nbytes) for k, v in items[r]]))
        ops, fresh, at = [], [], 0
        for res, (key, view), s in zip(reservations, items[r], sums[r], strict=True):
            if res.already_stored:
                continue
            staging[at : at + view.nbytes] = view
            ops.append(Op(SEGMENT_NAMES[Tier.DRAM], res.offset, staging.ctypes.data + at, view.nbytes))
            fresh.append((key, *s))
            at += view.nbytes
        try:
            peers.write(node_id, ops)
        except BaseException:
            call(node.abort_batch.remote([f[0] for f in fresh]))
            raise
        revision = max(revision, int(call(node.commit_batch.remote(fresh, replicated))))
    return revision
