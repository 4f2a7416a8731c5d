"""Which chunks to move or drop: recency per tier, pins, replica hints and tenants' quotas (no I/O).

The node's store asks this policy for candidates and does the moving itself, re-trying its allocator
after each one, because freed bytes are only useful once they form an extent large enough.  Recency is
``(last access time, access sequence)``: the clock orders accesses, the sequence breaks ties.  The unpinned chunks
are kept in that order (:class:`~kvpool.pool.node.recency.RecencyIndex`) by tier and copy, and by tier and tenant, so
that each candidate costs O(log n), not a sort of the tier.
"""

import itertools
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.core.types import Tier
from kvpool.errors import ConfigError
from kvpool.pool.node.recency import RecencyIndex

K = TypeVar("K", bound=Hashable)


@dataclass
class Entry:
    """The policy's entry for a chunk (its state in words: :class:`~kvpool.pool.chunks.ChunkState`): read it, change it only through the policy (its order follows these fields)."""

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
        self._chunks: dict[bytes, Entry] = {}
        self._seq = itertools.count()
        self._used: Counter[tuple[str, Tier]] = Counter()  #: bytes per (tenant, tier)
        self._counts: Counter[Tier] = Counter()  #: chunks per tier, pinned ones included
        self._order = RecencyIndex()  #: the unpinned chunks, by (tier, copy elsewhere) and by (tier, tenant)

    def add(self, key: bytes, tier: Tier, size: int, *, replicated: bool = False, tenant: str = "") -> None:
        if key in self._chunks:
            raise ConfigError(f"chunk {key.hex()[:16]} is already tracked")
        st = self._chunks[key] = Entry(
            tier, size, self.clock.time(), next(self._seq), replicated=replicated, tenant=tenant
        )
        self._used[(tenant, tier)] += size
        self._counts[tier] += 1
        self._place(key, st)

    def state(self, key: bytes) -> Entry:
        """``KeyError`` for an untracked chunk."""
        return self._chunks[key]

    def __contains__(self, key: bytes) -> bool:
        return key in self._chunks

    def touch(self, key: bytes) -> None:
        st = self._chunks[key]
        then = st.last_access
        st.last_access, st.seq = self.clock.time(), next(self._seq)
        if st.last_access < then:  # the wall clock stepped back: the order only follows a recency that grows
            self._place(key, st)
        elif not st.pins:
            self._order.touch(key)

    def move(self, key: bytes, tier: Tier, size: int | None = None) -> None:
        """The chunk now lives in ``tier`` (taking ``size`` bytes there, if another size); it keeps its recency."""
        st = self._chunks[key]
        self._used[(st.tenant, st.tier)] -= st.size
        self._counts[st.tier] -= 1
        st.tier, st.size = tier, st.size if size is None else size
        self._used[(st.tenant, tier)] += st.size
        self._counts[tier] += 1
        self._place(key, st)

    def mark_replicated(self, key: bytes) -> None:
        """Another copy of the chunk exists now (the remote tier's, or another node's): a full tier drops it first."""
        st = self._chunks[key]
        st.replicated = True
        self._place(key, st)

    def remove(self, key: bytes) -> Entry:
        st = self._chunks.pop(key)
        self._used[(st.tenant, st.tier)] -= st.size
        self._counts[st.tier] -= 1
        self._order.discard(key)
        return st

    def pin(self, key: bytes) -> None:
        self._chunks[key].pins += 1
        self._order.discard(key)

    def unpin(self, key: bytes) -> None:
        st = self._chunks[key]
        if st.pins <= 0:
            raise ConfigError(f"chunk {key.hex()[:16]} is not pinned")
        st.pins -= 1
        self._place(key, st)

    def _place(self, key: bytes, st: Entry) -> None:
        """Put the chunk where its state says in the order: out of it while pinned."""
        if st.pins:
            self._order.discard(key)
        else:
            self._order.put(key, st, (_by_copy(st.tier, st.replicated), _by_tenant(st.tier, st.tenant)))

    def lru(self, tier: Tier, tenant: str | None = None) -> Iterator[bytes]:
        """Unpinned chunks of ``tier`` (``tenant``'s only, if given), least recently used first: the order to
        migrate them.  Read as it goes (:meth:`RecencyIndex.walk`): a chunk pinned or removed meanwhile is skipped."""
        if tenant is None:
            return self._order.walk(_by_copy(tier, True), _by_copy(tier, False))
        return self._order.walk(_by_tenant(tier, tenant))

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
        yield from self._order.walk(_by_copy(tier, True))
        yield from self._order.walk(_by_copy(tier, False))

    def count(self, tier: Tier) -> int:
        return self._counts[tier]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the byte and chunk counts or the order disagree with the chunks' states (for
        tests and the store's audit; O(n))."""
        self._order.check_invariants()
        used: Counter[tuple[str, Tier]] = Counter()
        counts: Counter[Tier] = Counter()
        for key, st in self._chunks.items():
            used[(st.tenant, st.tier)] += st.size
            counts[st.tier] += 1
            groups = (_by_copy(st.tier, st.replicated), _by_tenant(st.tier, st.tenant))
            found = self._order.lookup(key)
            placed = found is None if st.pins else found is not None and found[0] is st and found[1] == groups
            _require(placed, f"chunk {key.hex()[:16]}: out of its place in the LRU order")
        _require(len(self._order) == sum(not st.pins for st in self._chunks.values()), "the order holds other chunks")
        _require(_nonzero(used) == _nonzero(self._used), "bytes per tenant and tier disagree with the chunks")
        _require(_nonzero(counts) == _nonzero(self._counts), "chunks per tier disagree with the chunks")


def _by_copy(tier: Tier, replicated: bool) -> Hashable:
    return ("copy", tier.value, replicated)  # the tier's name: an Enum member hashes in Python, a str's hash is kept


def _by_tenant(tier: Tier, tenant: str) -> Hashable:
    return ("tenant", tier.value, tenant)


def _nonzero(counter: Mapping[K, int]) -> dict[K, int]:
    return {k: n for k, n in counter.items() if n}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
