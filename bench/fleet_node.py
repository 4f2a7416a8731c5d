"""One simulated pool node: the pool's real :class:`~kvpool.pool.node.store.ChunkStore` (its allocators, LRU eviction
policy, watermarks, moves between DRAM and NVMe) over segments that hold no bytes.

The store is plain logic over two I/O seams: the segments it reads and writes bytes through, and the ``PoolNode``
actor that calls it under a lock and publishes its changes to etcd.  The first seam is replaced here by
:class:`Byteless` (a segment of a capacity that stores nothing: no KV byte is allocated for a simulated fleet), the
second by :class:`SimNode`, which makes the ``PoolNode``'s store calls in the ``PoolNode``'s order (prepare_store,
complete_store, prepare_load, complete_load, touch; the background demotion turn at once after a store instead of on
a thread) and hands the store's changes to the caller instead of etcd.  Its calls take the arguments and give the
answers of :class:`~kvpool.pool.protocol.NodeHandle`, so the client's own write path (:class:`~kvpool.pool.client.
writes.Rooms`, one room held per node) drives it.
"""

import heapq
from collections.abc import Sequence
from typing import cast

import msgspec

from kvpool.clock import Clock
from kvpool.core.types import Tier
from kvpool.pool.chunks import Change, Origin
from kvpool.pool.client.peers import rounds
from kvpool.pool.client.writes import Rooms
from kvpool.pool.config import Watermarks
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.protocol import Filled, Loaded, NodeHandle, Room, Stored
from kvpool.pool.segment import DramSegment, NvmeSegment

RESERVATION_TTL_S = 30.0  #: PoolConfig.reservation_ttl_s's default


class Byteless:
    """A segment of ``capacity`` bytes that stores none: writes are dropped, reads give no bytes.  The store's moves
    between two of them copy nothing (``pool/node/moves.py`` reads one and writes the other)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.path = "(simulated)"
        self.direct = False

    def write(self, offset: int, data: object) -> None:
        pass

    def read(self, offset: int, length: int) -> bytes:
        return b""

    def read_into(self, offset: int, dest: object) -> int:
        return 0

    def close(self) -> None:
        pass


class SimNode:
    """A pool node's store calls, without Ray, etcd or bytes (see the module's docstring)."""

    def __init__(
        self,
        node_id: str,
        dram_bytes: int,
        nvme_bytes: int,
        clock: Clock,
        *,
        watermarks: Watermarks | None = None,
        alignment: int = 4096,
        promote_on_hit: bool = True,
    ) -> None:
        self.node_id = node_id
        nvme = cast(NvmeSegment, Byteless(nvme_bytes)) if nvme_bytes > 0 else None
        self.store = ChunkStore(
            cast(DramSegment, Byteless(dram_bytes)),
            nvme,
            watermarks=watermarks,
            alignment=alignment,
            clock=clock,
            demote_inline=False,
        )
        self.promote_on_hit = promote_on_hit
        self.dram_capacity = self.store.allocators[Tier.DRAM].capacity

    @property
    def has_nvme(self) -> bool:
        return Tier.NVME in self.store.segments

    def changes(self) -> list[Change]:
        """What the node would publish now: every change of its store since the last call."""
        return self.store.take_changes()

    # -- NodeHandle's calls -------------------------------------------------------------------------

    def prepare_store(self, length: int) -> Room:
        moves = self.store.moves.demotions(need=length) if self.has_nvme else []
        if moves:
            self.store.moves.run(moves)
        return self.store.open_room(length, RESERVATION_TTL_S)

    def complete_store(
        self, room: Room, chunks: Sequence[Filled], replicated: bool, origin: Origin, next_length: int
    ) -> Stored:
        self.store.fill_room(
            room.id, [msgspec.structs.astuple(c) for c in chunks], replicated=replicated, origin=origin
        )
        nxt = None
        if 0 < next_length <= self.dram_capacity // 8 and self.store.allocators[Tier.DRAM].can_allocate(next_length):
            nxt = self.store.open_room(next_length, RESERVATION_TTL_S)
        self.demote()
        return Stored(0, nxt)

    def abort_store(self, room_id: int) -> None:
        self.store.close_room(room_id)

    def prepare_load(self, keys: list[bytes], promote: bool | None = None, copy_nvme: bool = False) -> Loaded:
        if self.promote_on_hit if promote is None else promote:
            moves = self.store.moves.promotions(keys)
            if moves:
                self.store.moves.run(moves)
        chunks = self.store.locate_each(keys)
        return Loaded(chunks, [None] * len(chunks))

    def complete_load(self, keys: list[bytes]) -> None:
        for key in keys:
            self.store.release(key)

    def touch(self, keys: list[bytes]) -> None:
        for key in keys:
            if key in self.store:
                self.store.policy.touch(key)
                self.store.counters["gets"] += 1

    def demote(self) -> None:
        """The node's background turn, at once: DRAM above its high watermark moves LRU chunks to NVMe until the low."""
        if self.store.over_high.is_set():
            self.store.over_high.clear()
            self.store.moves.run(self.store.moves.demotions())

    def handle(self) -> NodeHandle:
        """This node as the client's write path types it (the calls above, with the same signatures)."""
        return cast(NodeHandle, self)


def put(rooms: Rooms, node: SimNode, keys: Sequence[bytes], chunk_bytes: int) -> None:
    """Store ``keys`` (chunks of ``chunk_bytes``) on ``node`` by the client's write path: in rounds of at most a quarter
    of its DRAM, each into the room the client holds there (``Rooms``), one ``complete_store`` a round."""
    sizes = [chunk_bytes] * len(keys)
    for r in rounds(sizes, max(1, node.dram_capacity // 4)):
        batch = keys[r]
        room, offsets = rooms.take(node.node_id, node.handle(), sizes[r])
        chunks = [Filled(k, o, chunk_bytes, 0, None) for k, o in zip(batch, offsets, strict=True)]
        rooms.fill(node.node_id, node.handle(), room, chunks, False, Origin())


def read(reader: SimNode, holder: SimNode, keys: list[bytes], tier: Tier) -> None:
    """A client on ``reader`` reads ``keys`` from ``holder``, as the client's read path does: its own node's DRAM
    chunks by a touch (no pin), everything else pinned by ``prepare_load`` (NVMe hits promoted first) and released."""
    if reader is holder and tier is Tier.DRAM:
        holder.touch(keys)
    else:
        holder.prepare_load(keys)
        holder.complete_load(keys)


class Queues:
    """Each node's booked prefills: how many have not ended, and when the last one ends (a node prefills one request
    at a time, in the order they were booked)."""

    def __init__(self, nodes: int) -> None:
        self.busy = [0.0] * nodes  #: when each node's last booked prefill ends
        self.queued = [0] * nodes  #: booked prefills not ended, per node
        self.active: set[int] = set()  #: nodes with a booked prefill not ended
        self._ends: list[tuple[float, int]] = []  #: (end, node) of every booked prefill not ended

    def advance(self, now: float) -> None:
        """Forget the prefills that ended by ``now``."""
        while self._ends and self._ends[0][0] <= now:
            _, lane = heapq.heappop(self._ends)
            self.queued[lane] -= 1
            if not self.queued[lane]:
                self.active.discard(lane)

    def book(self, lane: int, now: float, seconds: float) -> None:
        self.busy[lane] = max(now, self.busy[lane]) + seconds
        heapq.heappush(self._ends, (self.busy[lane], lane))
        self.queued[lane] += 1
        self.active.add(lane)

    def of(self, lane: int, now: float) -> tuple[int, float]:
        """``(requests queued, seconds of prefill booked ahead)`` of node ``lane``."""
        return self.queued[lane], max(0.0, self.busy[lane] - now)
