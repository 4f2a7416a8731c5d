"""Offset allocation inside one storage segment: pure bookkeeping, no I/O.

The segment is ``[0, capacity)`` where ``capacity`` is the requested size rounded down to ``alignment``.
Every byte of it is in exactly one extent, either a live allocation or a free extent.  Free extents are
kept sorted by offset and always coalesced (no two are adjacent), so a request fails only when no single
free extent is large enough.  All offsets and sizes are multiples of ``alignment``.
"""

from bisect import bisect_left
from dataclasses import dataclass
from itertools import pairwise
from typing import Annotated

from msgspec import Meta

from kvpool.core.config import PowerOfTwo, checked, validated
from kvpool.errors import ConfigError, PoolFull

_Capacity = Annotated[int, Meta(ge=1, description="an int > 0 (bytes)")]


@dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of an :class:`OffsetAllocator`; ``used + free == capacity``."""

    capacity: int
    used: int
    free: int
    largest_free: int
    free_extents: int
    allocations: int
    fragmentation: float  #: ``1 - largest_free / free``; 0.0 when nothing is free


class OffsetAllocator:
    """First-fit allocator over the free extents of one segment.

    ``allocate`` is O(free extents); ``free`` finds its neighbours by bisection in O(log n) and then
    edits a Python list (a memmove, linear but small).
    """

    @checked
    def __init__(self, capacity: _Capacity, alignment: PowerOfTwo = 4096) -> None:
        if capacity < alignment:
            raise ConfigError(f"capacity must be at least one alignment unit ({alignment} B), got {capacity}")
        self._alignment = alignment
        self._capacity = capacity - capacity % alignment
        #: offsets of free extents, ascending; ``_free_size`` holds their sizes
        self._free_starts: list[int] = [0]
        self._free_size: dict[int, int] = {0: self._capacity}
        self._live: dict[int, int] = {}  #: offset -> rounded size of each live allocation
        self._used = 0

    @property
    def capacity(self) -> int:
        """Usable bytes: the requested capacity rounded down to ``alignment``."""
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used(self) -> int:
        """Bytes in live allocations, each counted at its rounded size."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def largest_free(self) -> int:
        """Size of the largest free extent (0 when the segment is full)."""
        return max(self._free_size.values(), default=0)

    @property
    def allocations(self) -> int:
        return len(self._live)

    def allocate(self, size: int) -> int:
        """Reserve ``size`` bytes (rounded up to ``alignment``) and return their offset.

        Takes the front of the lowest-offset free extent that fits.  Raises ``PoolFull`` when none fits,
        leaving the allocator unchanged; ``ConfigError`` for a size that is not an int > 0.
        """
        rounded = self._round(size)
        for i, start in enumerate(self._free_starts):
            extent = self._free_size[start]
            if extent < rounded:
                continue
            del self._free_size[start]
            if extent == rounded:
                del self._free_starts[i]
            else:  # the remainder keeps its place in the sorted list
                self._free_starts[i] = start + rounded
                self._free_size[start + rounded] = extent - rounded
            self._live[start] = rounded
            self._used += rounded
            return start
        stats = self.stats()
        aligned = f" ({_human(rounded)} aligned)" if rounded != size else ""
        raise PoolFull(
            f"cannot allocate {_human(size)}{aligned}: largest free extent is {_human(stats.largest_free)} "
            f"of {_human(stats.capacity)} capacity (fragmentation {stats.fragmentation:.2f}); "
            "free or evict allocations, or use a larger segment"
        )

    def claim(self, offset: int, size: int) -> None:
        """Make ``[offset, offset + size)`` (``size`` rounded up to ``alignment``) a live allocation; it must lie
        inside one free extent (``ConfigError`` otherwise, the allocator unchanged).  What a writer that carved
        a larger room freed a moment ago hands back, one chunk at a time."""
        rounded = self._round(size)
        if not _is_int(offset) or offset < 0 or offset % self._alignment:
            raise ConfigError(f"offset must be an int >= 0 and a multiple of {self._alignment}, got {offset!r:.40}")
        i = bisect_left(self._free_starts, offset + 1) - 1  # the free extent starting at or before offset
        start = self._free_starts[i] if i >= 0 else -1
        if start < 0 or offset + rounded > start + self._free_size[start]:
            raise ConfigError(f"[{offset}, +{rounded}) is not free: it overlaps a live allocation or the segment's end")
        end, extent_end = offset + rounded, start + self._free_size.pop(start)
        del self._free_starts[i]
        if end < extent_end:  # the free tail keeps its place in the sorted list
            self._free_starts.insert(i, end)
            self._free_size[end] = extent_end - end
        if start < offset:
            self._free_starts.insert(i, start)
            self._free_size[start] = offset - start
        self._live[offset] = rounded
        self._used += rounded

    def copy(self) -> "OffsetAllocator":
        """An independent allocator in the same state (to try frees on: see ``MoveBooks.demotions`` in pool/node/move_books.py)."""
        other = OffsetAllocator.__new__(OffsetAllocator)
        other.__dict__.update(self.__dict__)
        other._free_starts, other._free_size, other._live = (
            list(self._free_starts),
            dict(self._free_size),
            dict(self._live),
        )
        return other

    def can_allocate(self, size: int) -> bool:
        """Whether ``allocate(size)`` would succeed now."""
        return self._round(size) <= self.largest_free

    def size_of(self, offset: int) -> int:
        """The rounded size of the live allocation at ``offset``."""
        self._check_live(offset, "")
        return self._live[offset]

    def free(self, offset: int) -> None:
        """Release the live allocation at ``offset`` and merge it with free neighbours on both sides."""
        self._check_live(offset, " (never allocated, or already freed)")
        size = self._live.pop(offset)
        self._used -= size
        i = bisect_left(self._free_starts, offset)
        if i < len(self._free_starts) and self._free_starts[i] == offset + size:  # merge right
            size += self._free_size.pop(self._free_starts.pop(i))
        if i > 0:
            left = self._free_starts[i - 1]
            if left + self._free_size[left] == offset:  # merge left
                self._free_size[left] += size
                return
        self._free_starts.insert(i, offset)
        self._free_size[offset] = size

    def stats(self) -> AllocatorStats:
        free, largest = self.free_bytes, self.largest_free
        return AllocatorStats(
            capacity=self._capacity,
            used=self._used,
            free=free,
            largest_free=largest,
            free_extents=len(self._free_starts),
            allocations=len(self._live),
            fragmentation=1.0 - largest / free if free else 0.0,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (for tests; O(n log n))."""
        a = self._alignment
        _require(self._free_starts == sorted(self._free_size), "free list is not sorted or out of sync")
        extents = sorted(
            [(o, s, "free") for o, s in self._free_size.items()] + [(o, s, "live") for o, s in self._live.items()]
        )
        for (o1, s1, k1), (o2, _, k2) in pairwise(extents):
            _require(o1 + s1 <= o2, f"{k1} extent at {o1}+{s1} overlaps {k2} extent at {o2}")
            _require(not (k1 == k2 == "free" and o1 + s1 == o2), f"free extents at {o1} and {o2} not coalesced")
        for o, s, kind in extents:
            _require(s > 0 and o % a == 0 and s % a == 0, f"{kind} extent {o}+{s} is empty or not aligned to {a}")
            _require(o >= 0 and o + s <= self._capacity, f"{kind} extent {o}+{s} is outside the segment")
        _require(self._used == sum(self._live.values()), "used does not match live allocations")
        _require(self._used + sum(self._free_size.values()) == self._capacity, "used + free != capacity")

    def _check_live(self, offset: int, why: str) -> None:
        if not _is_int(offset) or offset not in self._live:
            raise ConfigError(f"offset {offset!r:.60} is not a live allocation{why}")

    def _round(self, size: int) -> int:
        if not _is_int(size) or size <= 0:  # the common, good size costs two tests; a bad one is worded by _Capacity
            size = validated(_Capacity, size, "size")
        return -(-size // self._alignment) * self._alignment


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _human(n: int) -> str:
    """``n`` bytes as a short string: ``512 B``, ``4.0 KiB``, ``5.0 MiB`` (up to TiB)."""
    exp = min((n.bit_length() - 1) // 10, 4) if n > 0 else 0
    return f"{n} B" if exp == 0 else f"{n / 1024**exp:.1f} {'BKMGT'[exp]}iB"
