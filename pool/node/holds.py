"""DRAM a node's store has handed to writers but that holds no chunk yet: single-chunk reservations (reserve → write →
commit) and writers' rooms (open → write → fill), each stamped with when it was made, so that what a writer that died
left behind is given back (Mooncake's PutStart without PutEnd).

Invariant: every hold is a live allocation of the DRAM allocator, given back exactly once (``abort``, ``close_room``,
``reap``) unless it becomes a chunk (``take``).  The store decides where a hold goes (it makes room by eviction);
this class only keeps the books.
"""

import logging
import secrets

from kvpool.clock import Clock
from kvpool.pool.chunks import Reservation, Room, short
from kvpool.pool.node.allocator import OffsetAllocator

log = logging.getLogger(__name__)


class Holds:
    def __init__(self, allocator: OffsetAllocator, clock: Clock) -> None:
        self.allocator, self.clock = allocator, clock
        self._reserved: dict[bytes, Reservation] = {}
        self._rooms: dict[int, Room] = {}

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has a reservation (is being written)."""
        return key in self._reserved

    def reserve(self, key: bytes, offset: int, length: int) -> Reservation:
        """Hold ``[offset, +length)``, allocated already, for ``key``'s chunk."""
        r = self._reserved[key] = Reservation(key, offset, length, at=self.clock.monotonic())
        return r

    def claim(self, key: bytes, offset: int, length: int) -> None:
        """Hold a range of a room just closed (its space given back) for ``key``, whose chunk is committed next."""
        self.allocator.claim(offset, length)
        self._reserved[key] = Reservation(key, offset, length)

    def get(self, key: bytes) -> Reservation | None:
        return self._reserved.get(key)

    def take(self, key: bytes) -> None:
        """``key``'s hold became its chunk: forget it, keeping its space allocated."""
        del self._reserved[key]

    def abort(self, key: object) -> None:
        """Give a reservation's space back; a key that is not reserved (or not a key) is left alone."""
        r = self._reserved.pop(key, None) if isinstance(key, bytes) else None
        if r is not None:
            self.allocator.free(r.offset)

    def open_room(self, offset: int, ttl_s: float) -> Room:
        """A room over the allocation at ``offset``, reclaimed by :meth:`reap` ``ttl_s`` after this unless filled."""
        room_id = secrets.randbits(63)  # random: a room of a node's earlier life is never taken for one of this
        room = Room(
            room_id, offset, self.allocator.size_of(offset), self.allocator.alignment, ttl_s, at=self.clock.monotonic()
        )
        self._rooms[room.id] = room
        return room

    def room(self, room_id: object) -> Room | None:
        return self._rooms.get(room_id) if isinstance(room_id, int) else None

    def close_room(self, room_id: object) -> None:
        """Give a room's space back; an unknown room is left alone (cleanup goes on past it)."""
        room = self._rooms.pop(room_id, None) if isinstance(room_id, int) else None
        if room is not None:
            self.allocator.free(room.offset)

    def reap(self, max_age_s: float) -> int:
        """Give back reservations older than ``max_age_s`` and rooms past their own TTL; returns how many."""
        now = self.clock.monotonic()
        expired = [k for k, r in self._reserved.items() if now - r.at > max_age_s]
        for key in expired:
            log.warning("chunk %s reserved %.0f s ago was never committed: space reclaimed", short(key), max_age_s)
            self.abort(key)
        idle = [i for i, room in self._rooms.items() if now - room.at > room.ttl_s]
        for room_id in idle:
            self.close_room(room_id)
        return len(expired) + len(idle)

    def offsets(self) -> list[int]:
        """Where every hold starts (for the store's audit)."""
        return [r.offset for r in self._reserved.values()] + [r.offset for r in self._rooms.values()]
