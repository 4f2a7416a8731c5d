"""Which chunks to move or drop: recency per tier, pins, and replica hints (no I/O).

The node's store asks this policy for candidates and does the moving itself, re-trying its allocator
after each one, because freed bytes are only useful once they form an extent large enough.  Recency is
``(last access time, access sequence)``: the clock orders accesses, the sequence breaks ties.
"""

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.errors import ConfigError
from kvpool.pool.types import Tier


@dataclass
class ChunkState:
    tier: Tier
    size: int
    last_access: float
    seq: int
    pins: int = 0  #: readers in flight; a pinned chunk is never moved or dropped
    replicated: bool = False  #: another node holds a copy, so dropping this one loses nothing


class EvictionPolicy:
    name = "lru"  #: what a tombstone of an eviction says chose it

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._chunks: dict[bytes, ChunkState] = {}
        self._seq = itertools.count()

    def add(self, key: bytes, tier: Tier, size: int, *, replicated: bool = False) -> None:
        if key in self._chunks:
            raise ConfigError(f"chunk {key.hex()[:16]} is already tracked")
        self._chunks[key] = ChunkState(tier, size, self.clock.time(), next(self._seq), replicated=replicated)

    def state(self, key: bytes) -> ChunkState:
        """``KeyError`` for an untracked chunk."""
        return self._chunks[key]

    def __contains__(self, key: bytes) -> bool:
        return key in self._chunks

    def touch(self, key: bytes) -> None:
        st = self._chunks[key]
        st.last_access, st.seq = self.clock.time(), next(self._seq)

    def move(self, key: bytes, tier: Tier) -> None:
        """The chunk now lives in ``tier``; it keeps its recency."""
        self._chunks[key].tier = tier

    def remove(self, key: bytes) -> ChunkState:
        return self._chunks.pop(key)

    def pin(self, key: bytes) -> None:
        self._chunks[key].pins += 1

    def unpin(self, key: bytes) -> None:
        st = self._chunks[key]
        if st.pins <= 0:
            raise ConfigError(f"chunk {key.hex()[:16]} is not pinned")
        st.pins -= 1

    def lru(self, tier: Tier) -> Iterator[bytes]:
        """Unpinned chunks of ``tier``, least recently used first: the order to migrate them."""
        items = [(st.last_access, st.seq, k) for k, st in self._chunks.items() if st.tier is tier and not st.pins]
        return (k for _, _, k in sorted(items))

    def drop_order(self, tier: Tier) -> Iterator[bytes]:
        """Unpinned chunks of ``tier`` in the order to drop them: those with a copy elsewhere first, each
        group least recently used first."""
        order = list(self.lru(tier))
        yield from (k for k in order if self._chunks[k].replicated)
        yield from (k for k in order if not self._chunks[k].replicated)

    def count(self, tier: Tier) -> int:
        return sum(1 for st in self._chunks.values() if st.tier is tier)
