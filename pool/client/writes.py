"""The write path: a batch's bytes into one node's DRAM, in a room the client holds there, with one call per batch.

A client keeps one :class:`~kvpool.pool.protocol.Room` per node it writes to: DRAM the node set aside for its next
batch before the keys were known.  The client lays the batch's chunks out in the room, writes them (same node:
straight into the mapped segment; a peer: from the registered staging buffer with one batched one-sided WRITE),
and hands them over with ``complete_store``, whose reply opens the next room.  So a batch costs one Ray call and one
etcd transaction; only the first batch on a node, or one larger than the room held, opens a room first
(``prepare_store``).

In rounds, since room set aside cannot be evicted to make more: at most a quarter of the holder's DRAM (and of
the staging buffer) per round.  A room is used only within half its TTL, after which its node may reclaim it.
Keys name content: a key the holder has already keeps its first copy (the bytes written again are freed).
"""

import contextlib
import threading
import time
from collections.abc import Callable, Sequence

from kvpool.core.types import NodeRecord, Tier
from kvpool.errors import ChunkNotFound, PoolFull
from kvpool.metadata.cache import MetadataCache
from kvpool.pool.chunks import SEGMENT_NAMES, Origin, gather_checked
from kvpool.pool.client.peers import STAGING_BYTES, Peers, node_record, rounds
from kvpool.pool.protocol import Filled, NodeHandle, Room
from kvpool.pool.segment import DramSegment
from kvpool.pool.tiers.codecs import TensorFormat
from kvpool.transport.base import Op

Item = tuple[bytes, list[memoryview]]  #: a chunk to write: its key and its bytes, in order over one or more regions
Write = Callable[[Room, list[int]], list[int]]  #: writes a round's chunks at these offsets of a room; their checksums


def nbytes(item: Item) -> int:
    return sum(p.nbytes for p in item[1])


PAGE = 4096  #: the alignment a room is expected to have before the first one is seen


def targets(nodes: Sequence[NodeRecord], here: str | None, replicas: int) -> list[str]:
    """The ``replicas`` nodes a put writes to when the caller names none: ``here`` (the writer's own node, when it has
    a pool node) first, then those with the most free space."""
    if len(nodes) < replicas:
        raise PoolFull(f"replicas={replicas} needs {replicas} pool nodes; {len(nodes)} are alive")
    free = {n.node_id: sum(s.capacity - s.used for s in n.segments) for n in nodes}
    return sorted(free, key=lambda nid: (nid != here, -free[nid]))[:replicas]


def room_bytes(sizes: Sequence[int], alignment: int) -> int:
    """DRAM a room needs to hold chunks of ``sizes`` on ``alignment`` boundaries."""
    return sum(-(-s // alignment) * alignment for s in sizes)


class Rooms:
    """The rooms a client holds, one per node, and when each was handed to it; ``cache``: the node records, which
    name each node's process now (None: none to check a room against, as in a simulation)."""

    def __init__(self, cache: MetadataCache | None = None) -> None:
        self.cache = cache
        self._lock = threading.Lock()
        self._held: dict[str, tuple[NodeHandle, Room, float]] = {}  #: node id -> (its node, the room, when received)
        self._alignment = PAGE

    def take(self, node_id: str, node: NodeHandle, sizes: Sequence[int]) -> tuple[Room, list[int]]:
        """A room on ``node_id``  for chunks of ``sizes``, and their offsets in it: the room
        held there if they fit, it is fresh and ``node`` opened it, else a new one (the one held is closed, not waited
        for).  A room another handle opened, or another process than the node's record names now, is an earlier
        actor's, if the node was started again: its offsets may hold the new node's chunks."""
        with self._lock:
            holder, held, received = self._held.pop(node_id, (node, None, 0.0))
        if held is not None:
            offsets = held.carve(list(sizes))
            if offsets is not None and holder is node and self._fresh(node_id, held, received):
                return held, offsets
            holder.abort_store(held.id)
        for _ in range(2):  # a second time only if the node's alignment is not the one assumed
            room = node.prepare_store(room_bytes(sizes, self._alignment))
            self._alignment = room.alignment
            if (offsets := room.carve(list(sizes))) is not None:
                return room, offsets
            node.abort_store(room.id)
        raise AssertionError(f"a room of {room.length} bytes cannot hold {len(sizes)} chunks it was opened for")

    def _fresh(self, node_id: str, room: Room, received: float) -> bool:
        """Whether ``room`` may take a batch: within half its TTL, and opened by the process the node's record names."""
        young = time.monotonic() - received < room.ttl_s / 2
        if self.cache is None or not room.pid:
            return young
        record = node_record(self.cache, node_id)
        return young and record is not None and record.pid == room.pid

    def fill(
        self,
        node_id: str,
        node: NodeHandle,
        room: Room,
        chunks: list[Filled],
        replicated: bool,
        origin: Origin,
    ) -> int:
        """Hand the chunks written into ``room`` over as ``origin``'s (one call, which opens the next room of the same
        size); the etcd revision that shows them."""
        stored = node.complete_store(room, chunks, replicated, origin, next_length=room.length)
        if (nxt := stored.next_room) is not None:
            with self._lock:
                old = self._held.pop(node_id, None)
                self._held[node_id] = (node, nxt, time.monotonic())
            if old is not None:  # another thread of this client wrote there meanwhile
                old[0].abort_store(old[1].id)
        return stored.revision

    def close(self) -> None:
        """Give every room back (not waited for)."""
        with self._lock:
            held, self._held = self._held, {}
        for node, room, _ in held.values():
            with contextlib.suppress(Exception):  # a node gone meanwhile took its rooms along
                node.abort_store(room.id)


def _put_round(
    rooms: Rooms,
    node_id: str,
    node: NodeHandle,
    items: Sequence[Item],
    formats: Sequence[TensorFormat | None],
    replicated: bool,
    write: Write,
    origin: Origin,
) -> int:
    """One round: a room for ``items``, ``write(offsets)`` of their bytes into it (checksummed as they land), the
    fill; the etcd revision that shows them.  A room the node no longer has (reclaimed after its TTL, or the node
    restarted) is written again into a new one, once."""
    for attempt in range(2):
        room, offsets = rooms.take(node_id, node, [nbytes(i) for i in items])
        try:
            sums = write(room, offsets)
        except BaseException:
            node.abort_store(room.id)
            raise
        chunks = [
            Filled(k, o, nbytes((k, v)), crc, fmt)
            for o, (k, v), crc, fmt in zip(offsets, items, sums, formats, strict=True)
        ]
        try:
            return rooms.fill(node_id, node, room, chunks, replicated, origin)
        except ChunkNotFound:
            if attempt:
                raise
    raise AssertionError("unreachable")


def put_local(
    node: NodeHandle,
    node_id: str,
    rooms: Rooms,
    segment: DramSegment,
    items: Sequence[Item],
    formats: Sequence[TensorFormat | None],
    replicated: bool,
    origin: Origin,
) -> int:
    """Write ``items`` into this node (``segment``: its mapped DRAM), each gathered and checksummed in one pass; the
    etcd revision that shows them."""
    revision = 0
    for r in rounds([nbytes(i) for i in items], max(1, segment.capacity // 4)):

        def write(_: Room, offsets: list[int], batch: Sequence[Item] = items[r]) -> list[int]:
            sums = []
            for offset, item in zip(offsets, batch, strict=True):
                with segment.view(offset, nbytes(item)) as dest:
                    sums.append(gather_checked(item[1], dest))
            return sums

        revision = max(revision, _put_round(rooms, node_id, node, items[r], formats[r], replicated, write, origin))
    return revision


def put_peer(
    node: NodeHandle,
    node_id: str,
    rooms: Rooms,
    peers: Peers,
    dram_bytes: int,
    items: Sequence[Item],
    formats: Sequence[TensorFormat | None],
    replicated: bool,
    origin: Origin,
) -> int:
    """Write ``items`` into the peer ``node_id`` (``dram_bytes``: its DRAM capacity) from the staging buffer (each
    gathered and checksummed there in one pass), one batched one-sided WRITE a round; the etcd revision that shows
    them."""
    revision = 0
    for r in rounds([nbytes(i) for i in items], min(max(dram_bytes // 4, 1), STAGING_BYTES)):

        def write(room: Room, offsets: list[int], batch: Sequence[Item] = items[r]) -> list[int]:
            staging = peers.staging(sum(nbytes(i) for i in batch))
            ops, sums, at = [], [], 0
            for offset, item in zip(offsets, batch, strict=True):
                n = nbytes(item)
                sums.append(gather_checked(item[1], staging[at : at + n].data))
                ops.append(Op(SEGMENT_NAMES[Tier.DRAM], offset, staging.ctypes.data + at, n))
                at += n
            peers.write(node_id, ops, room.pid)  # refused if the node was started again since the room opened
            return sums

        revision = max(revision, _put_round(rooms, node_id, node, items[r], formats[r], replicated, write, origin))
    return revision
