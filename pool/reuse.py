"""Reuse distances of prefix lookups over per-node LRU stacks, sampled SHARDS-style: miss-ratio curves in bounded memory.

Each access to a chunk object has a *reuse distance*: the bytes of distinct objects accessed since the last access
to the same object, plus its own (infinite on a first access).  Under LRU, an access hits a cache of ``C`` bytes
exactly when its reuse distance is at most ``C``, so the histogram of distances gives the hit ratio at every
capacity at once — the miss-ratio curve (Mattson et al., 1970).

kvpool is not one such cache, in two ways the curve models exactly:

- **One LRU stack per node.**  A chunk stays on the node that put it — the node of the client whose lookup first
  missed it — and each node evicts its own LRU end.  So an object's distance counts only the objects *of its
  node* accessed since its last access, and it hits when that is within its node's capacity.  With nodes of
  unequal size the distance is divided by the node's share of the pool, so one axis (pool bytes) serves every node.
- **The prefix rule.**  A lookup reuses the leading chunks the pool holds and recomputes everything after the
  first missing one, held or not.  Object ``j`` of a lookup is reused at capacity ``C`` iff every object before it
  hits, i.e. iff the running maximum of the distances of objects ``0..j`` is within ``C``: recording that running
  maximum instead of the distance keeps one histogram for every capacity.

kvpool's tiers act as one LRU stack per node: DRAM holds the most recently used bytes, demotion moves its LRU end
to NVMe, a hit promotes back; so an access hits DRAM within the DRAM capacity and NVMe within DRAM + NVMe.

SHARDS (Waldspurger et al., FAST '15) keeps only the accesses to keys whose hash falls under a threshold — a spatial
sample at rate ``R`` — and scales each sampled distance by ``1/R``; the sample's shortfall or excess against ``R``
of all accesses is added at distance 0 (SHARDS_adj).  When more than ``max_keys`` distinct sampled keys are tracked,
the rate halves and the keys above the new threshold are forgotten, so memory stays bounded.  Distances come from a
Fenwick tree per node over the sampled accesses' logical times (``O(log n)`` each).  The running maximum of a
sampled lookup sees only its sampled objects, so it can miss a larger distance between them (and runs
optimistic); sampling whole lookups by their first key instead would see every lookup whole, but a chain hash
makes the first key the root of a prefix tree, so that samples trees, not keys — all or nothing under one shared
system prompt — and measured worse (docs/routing.md, "Capacity advice").
"""

import hashlib
import math
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from kvpool.core.config import Fraction, Positive, checked

_HASH_SPACE = 1 << 64


def key_hash(key: bytes) -> int:
    """A uniform 64-bit hash of a chunk key (keys are SHA-256 digests already; others are hashed)."""
    if len(key) == 32:
        return int.from_bytes(key[:8], "big")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def threshold(rate: float) -> int:
    """The hash threshold of a sampling rate: a key is in the sample when its hash is below it."""
    return int(rate * _HASH_SPACE)


class _Fenwick:
    """Sums of sizes by logical time: ``add(t, v)`` and ``suffix(t)`` (the sum over times after ``t``)."""

    def __init__(self, n: int) -> None:
        self.n, self.tree, self.total = n, [0] * (n + 1), 0

    def add(self, t: int, value: int) -> None:
        self.total += value
        i = t + 1
        while i <= self.n:
            self.tree[i] += value
            i += i & -i

    def prefix(self, t: int) -> int:
        """Sum over times ``<= t``."""
        s, i = 0, t + 1
        while i > 0:
            s += self.tree[i]
            i -= i & -i
        return s

    def suffix(self, t: int) -> int:
        return self.total - self.prefix(t)


_Share = Annotated[float, Meta(gt=0, description="a node's share of the pool, a number > 0")]
_Capacity = Annotated[float, Meta(ge=0, le=1.7976931348623157e308, description="a capacity in bytes >= 0")]


class ReuseSampler:
    """Feed it lookups (``lookup(items, node)``, or single accesses); it keeps a weighted histogram of the sampled
    running-maximum reuse distances.  ``per_node``: one LRU stack per node, each key on the node of the lookup that
    first touched it (else one stack for the pool).  ``shares``: each node's fraction of the pool's capacity, to
    normalise distances by (default: the nodes are equal, and the curve divides a capacity among those seen).
    ``logged_at``: the capacity the lookups ran at, in the curve's units (a node's bytes, or the pool's when
    normalised): a key the lookup found not held although its distance is within it was not missing for want of
    room but because a concurrent lookup was still computing and writing it, which no capacity changes, so it
    counts as a miss at every capacity."""

    @checked
    def __init__(
        self,
        rate: Fraction = 0.01,
        max_keys: Positive = 100_000,
        *,
        per_node: bool = True,
        shares: dict[str, _Share] | None = None,
        logged_at: _Capacity = 0.0,
    ) -> None:
        self.rate, self.max_keys, self.per_node, self.logged_at = float(rate), max_keys, per_node, logged_at
        self.shares = dict(shares) if shares is not None else None
        self._threshold = threshold(self.rate)
        self._last: dict[bytes, tuple[int, int, int, str]] = {}  #: sampled key -> (time, size, hash, node)
        self._times: dict[str, _Fenwick] = {}  #: node -> sizes of its keys by their last access time
        self._now = 0
        self.distances: dict[float, float] = {}  #: running-max distance (bytes, scaled) -> weight
        self.cold = 0.0  #: weight of accesses at or after a first access in their lookup (infinite distance)
        self.accesses = 0  #: accesses offered, sampled or not
        self.nodes: set[str] = set()  #: the nodes keys were placed on

    def access(self, key: bytes, size: int, node: str = "") -> None:
        """One access, as a lookup of one key (no prefix rule)."""
        self.lookup([(key, size)], node)

    def lookup(self, items: Sequence[tuple[bytes, int]], node: str = "", unheld: Collection[int] = ()) -> None:
        """A prefix lookup from a client on ``node`` of ``(key, size)`` in chain order (the sampled ones of it, or
        all: keys out of the sample are skipped here); ``unheld``: the positions of the keys it found not held."""
        self.accesses += len(items)
        weight, running = 1.0 / self.rate, 0.0
        for j, (key, size) in enumerate(items):
            h = key_hash(key)
            if h >= self._threshold:
                continue
            distance = self._touch(key, size, h, node)
            if j in unheld and distance <= self.logged_at:
                distance = math.inf  # being written by a concurrent lookup: see logged_at
            running = max(running, distance)
            if running == math.inf:
                self.cold += weight
            else:
                self.distances[running] = self.distances.get(running, 0.0) + weight

    def _touch(self, key: bytes, size: int, h: int, node: str) -> float:
        """Move ``key`` to the top of its node's stack; its distance, scaled and normalised (inf: first access)."""
        seen = self._last.get(key)
        owner = (seen[3] if seen is not None else node) if self.per_node else ""
        times = self._times.get(owner)
        if times is None:
            times = self._times[owner] = _Fenwick(4 * self.max_keys)
            self.nodes.add(owner)
        distance = math.inf
        if seen is not None:
            t, old_size, _, _ = seen
            between = times.suffix(t)  # sizes of the node's sampled keys accessed after this one's last access
            times.add(t, -old_size)
            distance = int(between / self.rate) + size  # the node's LRU stack down to and including this key
            if self.shares is not None:
                distance /= self.shares.get(owner, 1.0 / max(1, len(self.shares)))
        if self._now >= times.n:
            self._compact()
            times = self._times[owner]
        self._last[key] = (self._now, size, h, owner)
        times.add(self._now, size)
        self._now += 1
        if len(self._last) > self.max_keys:
            self._lower_rate()
        return distance

    def _compact(self) -> None:
        """Renumber the live keys' times 0.. in order (times only grow; each tree has room for 4x max_keys)."""
        live = sorted(self._last.items(), key=lambda kv: kv[1][0])
        self._times = {node: _Fenwick(4 * self.max_keys) for node in self._times}
        for now, (key, (_, size, h, node)) in enumerate(live):
            self._last[key] = (now, size, h, node)
            self._times[node].add(now, size)
        self._now = len(live)

    def _lower_rate(self) -> None:
        """Halve the rate and forget the keys above the new threshold (SHARDS with a fixed number of keys)."""
        self.rate /= 2
        self._threshold //= 2
        for key, (t, size, h, node) in list(self._last.items()):
            if h >= self._threshold:
                self._times[node].add(t, -size)
                del self._last[key]

    def curve(self) -> "MissRatioCurve":
        """The miss-ratio curve so far, with SHARDS' adjustment: a spatial sample holds more or fewer accesses than
        ``rate`` of them (a popular key sampled or not swings it), and the difference is mostly hits to the hottest
        keys, so it is added at the smallest distance."""
        distances = dict(self.distances)
        sampled = self.cold + sum(distances.values())
        if sampled:
            distances[0] = distances.get(0, 0.0) + self.accesses - sampled
        nodes = 1 if self.shares is not None else max(1, len(self.nodes))
        return MissRatioCurve(distances, self.cold, nodes)


@dataclass(frozen=True)
class MissRatioCurve:
    distances: Mapping[float, float]  #: reuse distance (a node's bytes, or pool bytes when normalised) -> weight
    cold: float  #: weight of accesses never reused at any capacity
    nodes: int = 1  #: the pool's capacity is split evenly over this many nodes, each its own stack

    @property
    def total(self) -> float:
        return max(self.cold + sum(self.distances.values()), 0.0)

    def hit_ratio(self, capacity: float) -> float:
        """Fraction of accesses a pool of ``capacity`` bytes (all nodes together) would reuse."""
        total = self.total
        if not total:
            return 0.0
        per_node = capacity / self.nodes
        return min(max(sum(w for d, w in self.distances.items() if d <= per_node) / total, 0.0), 1.0)

    def ceiling(self) -> float:
        """The hit ratio of an infinite pool: every access but those at or after a first access in a lookup."""
        return self.hit_ratio(math.inf)


@dataclass(frozen=True)
class TierHits:
    dram: float  #: fraction of accesses served from DRAM
    nvme: float  #: from NVMe
    recomputed: float  #: the rest: misses


def tier_hits(curve: MissRatioCurve, dram_bytes: float, nvme_bytes: float, nvme_ratio: float = 1.0) -> TierHits:
    """Hit ratios of DRAM and NVMe tiers of these capacities, NVMe storing chunks ``nvme_ratio`` times smaller."""
    dram = curve.hit_ratio(dram_bytes)
    both = curve.hit_ratio(dram_bytes + nvme_bytes * nvme_ratio)
    return TierHits(dram, both - dram, 1.0 - both)


def lru_hit_ratio(accesses: Iterable[tuple[bytes, int]], capacity: int) -> float:
    """Exact LRU simulation (byte capacity, whole chunks), for checking the curve: the fraction of accesses hit."""
    return prefix_lru_hit_ratio((("", [a]) for a in accesses), {"": capacity}, per_node=False)


def prefix_lru_hit_ratio(
    lookups: Iterable[tuple[str, Sequence[tuple[bytes, int]]]], capacity: Mapping[str, int], per_node: bool = True
) -> float:
    """Exact simulation of the model the curve predicts, for checking it: one LRU cache per node of
    ``capacity[node]`` bytes, each key on the node whose lookup first touched it (``per_node=False``: one cache of
    ``capacity[""]``); every lookup ``(node, [(key, size), ...])`` touches each of its keys on the key's node,
    putting back those not held; an access is reused iff it and every access before it in its lookup hit."""
    caches: dict[str, OrderedDict[bytes, int]] = {}
    used: dict[str, int] = {}
    owner: dict[bytes, str] = {}
    reused = n = 0
    for node, items in lookups:
        prefix = True
        for key, size in items:
            n += 1
            home = owner.setdefault(key, node if per_node else "")
            cache = caches.setdefault(home, OrderedDict())
            if key in cache:
                cache.move_to_end(key)
                reused += prefix
                continue
            prefix = False
            cache[key] = size
            used[home] = used.get(home, 0) + size
            while used[home] > capacity[home] and cache:
                used[home] -= cache.popitem(last=False)[1]
    return reused / n if n else 0.0
