"""DRAM a node's store has handed to writers but that holds no chunk yet: writers' rooms (open → write → fill), each
stamped with when it was opened (and by which process: ``Room.pid``), so that what a writer that died left behind is given back (Mooncake's PutStart
without PutEnd).

Invariant: every room is a live allocation of the DRAM allocator, given back exactly once (``close_room``, ``reap``);
a fill closes its room first and claims the chunks' ranges again.  The store decides where a room goes (it makes
room by eviction); this class only keeps the books.
"""

import os
import secrets

from kvpool.clock import Clock
from kvpool.pool.node.allocator import OffsetAllocator
from kvpool.pool.protocol import Room


class Holds:
    def __init__(self, allocator: OffsetAllocator, clock: Clock) -> None:
        self.allocator, self.clock = allocator, clock
        self._rooms: dict[int, Room] = {}

    def open_room(self, offset: int, ttl_s: float) -> Room:
        """A room over the allocation at ``offset``, reclaimed by :meth:`reap` ``ttl_s`` after this unless filled."""
        room_id = secrets.randbits(63)  # random: a room of a node's earlier life is never taken for one of this
        size, alignment = self.allocator.size_of(offset), self.allocator.alignment
        room = Room(room_id, offset, size, alignment, ttl_s, at=self.clock.monotonic(), pid=os.getpid())
        self._rooms[room.id] = room
        return room

    def room(self, room_id: object) -> Room | None:
        return self._rooms.get(room_id) if isinstance(room_id, int) else None

    def close_room(self, room_id: object) -> None:
        """Give a room's space back; an unknown room is left alone (cleanup goes on past it)."""
        room = self._rooms.pop(room_id, None) if isinstance(room_id, int) else None
        if room is not None:
            self.allocator.free(room.offset)

    def reap(self) -> int:
        """Give back rooms past their own TTL; returns how many."""
        now = self.clock.monotonic()
        idle = [i for i, room in self._rooms.items() if now - room.at > room.ttl_s]
        for room_id in idle:
            self.close_room(room_id)
        return len(idle)

    def offsets(self) -> list[int]:
        """Where every room starts (for the store's audit)."""
        return [r.offset for r in self._rooms.values()]
