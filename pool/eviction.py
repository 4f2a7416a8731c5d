"""Which chunks to move or drop: recency per tier, pins, replica hints and tenants' quotas (no I/O).

The node's store asks this policy for candidates and does the moving itself, re-trying its allocator
after each one, because freed bytes are only useful once they form an extent large enough.  Recency is
``(last access time, access sequence)``: the clock orders accesses, the sequence breaks ties.
"""

import itertools
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.core.types import Tier
from kvpool.errors import ConfigError


@dataclass
class ChunkState:
    tier: Tier
    size: int
    last_access: float
    seq: int
    pins: int = 0  #: readers in flight; a pinned chunk is never moved or dropped
    replicated: bool = False  #: another node holds a copy, so dropping this one loses nothing
    tenant: str = ""  #: who put it ("" for no tenant)


class EvictionPolicy:
    name = "lru"  #: what a tombstone of an eviction says chose it

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._chunks: dict[bytes, ChunkState] = {}
        self._seq = itertools.count()
        self._used: Counter[tuple[str, Tier]] = Counter()  #: bytes per (tenant, tier)

    def add(self, key: bytes, tier: Tier, size: int, *, replicated: bool = False, tenant: str = "") -> None:
        if key in self._chunks:
            raise ConfigError(f"chunk {key.hex()[:16]} is already tracked")
        self._chunks[key] = ChunkState(tier, size, self.clock.time(), next(self._seq), replicated=replicated,
                                       tenant=tenant)  # fmt: skip
        self._used[(tenant, tier)] += size

    def state(self, key: bytes) -> ChunkState:
        """``KeyError`` for an untracked chunk."""
        return self._chunks[key]

    def __contains__(self, key: bytes) -> bool:
        return key in self._chunks

    def touch(self, key: bytes) -> None:
        st = self._chunks[key]
        st.last_access, st.seq = self.clock.time(), next(self._seq)

    def move(self, key: bytes, tier: Tier, size: int | None = None) -> None:
        """The chunk now lives in ``tier`` (taking ``size`` bytes there, if another size); it keeps its recency."""
        st = self._chunks[key]
        self._used[(st.tenant, st.tier)] -= st.size
        st.tier, st.size = tier, st.size if size is None else size
        self._used[(st.tenant, tier)] += st.size

    def remove(self, key: bytes) -> ChunkState:
        st = self._chunks.pop(key)
        self._used[(st.tenant, st.tier)] -= st.size
        return st

    def pin(self, key: bytes) -> None:
        self._chunks[key].pins += 1

    def unpin(self, key: bytes) -> None:
        st = self._chunks[key]
        if st.pins <= 0:
            raise ConfigError(f"chunk {key.hex()[:16]} is not pinned")
        st.pins -= 1

    def lru(self, tier: Tier, tenant: str | None = None) -> Iterator[bytes]:
        """Unpinned chunks of ``tier`` (``tenant``'s only, if given), least recently used first: the order to
        migrate them."""
        items = [(st.last_access, st.seq, k) for k, st in self._chunks.items()
                 if st.tier is tier and not st.pins and (tenant is None or st.tenant == tenant)]  # fmt: skip
        return (k for _, _, k in sorted(items))

    def used(self) -> dict[str, dict[Tier, int]]:
        """Bytes each tenant holds per tier (tenants with none left out)."""
        out: dict[str, dict[Tier, int]] = {}
        for (tenant, tier), n in self._used.items():
            if n:
                out.setdefault(tenant, {})[tier] = n
        return out

    def over_quota(self, quotas: Mapping[str, tuple[int, int]], tier: Tier) -> list[bytes]:
        """Unpinned chunks to take out of ``tier`` so that every tenant is within its quota there (``quotas``:
        tenant → (DRAM bytes, NVMe bytes), 0 for none): of each tenant over it, its own least recently used first."""
        out: list[bytes] = []
        for tenant, limits in quotas.items():
            limit = limits[0 if tier is Tier.DRAM else 1]
            excess = self._used[(tenant, tier)] - limit
            for key in self.lru(tier, tenant) if limit and excess > 0 else ():
                if excess <= 0:
                    break
                out.append(key)
                excess -= self._chunks[key].size
        return out

    def drop_order(self, tier: Tier) -> Iterator[bytes]:
        """Unpinned chunks of ``tier`` in the order to drop them: those with a copy elsewhere first, each
        group least recently used first."""
        order = list(self.lru(tier))
        yield from (k for k in order if self._chunks[k].replicated)
        yield from (k for k in order if not self._chunks[k].replicated)

    def count(self, tier: Tier) -> int:
        return sum(1 for st in self._chunks.values() if st.tier is tier)
