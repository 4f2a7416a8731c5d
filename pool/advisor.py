"""Capacity advice from a chunk-access stream: miss-ratio curves by SHARDS-style sampling, in bounded memory.

Each access to a chunk has a *reuse distance*: the bytes of distinct chunks accessed since the last access to the
same chunk, plus its own (infinite on a first access).  Under LRU, an access hits a cache of ``C`` bytes exactly
when its reuse distance is at most ``C``, so the histogram of distances gives the hit ratio at every capacity at once — the
miss-ratio curve (Mattson et al., 1970).  kvpool's tiers behave as one LRU stack: DRAM holds the most recently used
bytes, demotion moves the LRU end to NVMe, a hit promotes back, so an access hits DRAM when its distance is within
the DRAM capacity and NVMe when it is within DRAM + NVMe.  An NVMe codec that stores chunks ``r`` times smaller
makes NVMe hold ``r`` times more chunk bytes.

SHARDS (Waldspurger et al., FAST '15) keeps only the accesses to keys whose hash falls under a threshold — a
spatially hashed sample at rate ``R`` — and scales each sampled distance by ``1/R``; each sampled access stands
for ``1/R`` accesses, and the sample's shortfall or excess against ``R`` of all accesses is added at distance 0
(SHARDS_adj: mostly the hottest keys, which a spatial sample catches or misses whole).  When more than ``max_keys`` distinct sampled keys are tracked, the rate halves and the keys
above the new threshold are forgotten, so memory stays bounded whatever the stream.  Distances are computed with a
Fenwick tree over the sampled accesses' logical times (``O(log n)`` each).
"""

import hashlib
import json
import math
import os
import socket
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvpool.errors import ConfigError

_HASH_SPACE = 1 << 64


def _key_hash(key: bytes) -> int:
    """A uniform 64-bit hash of a chunk key (keys are SHA-256 digests already; others are hashed)."""
    if len(key) == 32:
        return int.from_bytes(key[:8], "big")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


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


class ReuseSampler:
    """Feed it accesses (``access(key, size)``); it keeps a weighted histogram of sampled reuse distances."""

    def __init__(self, rate: float = 0.01, max_keys: int = 100_000) -> None:
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate <= 1:
            raise ConfigError(f"sampling rate must be in (0, 1], got {rate!r}")
        if not isinstance(max_keys, int) or isinstance(max_keys, bool) or max_keys < 1:
            raise ConfigError(f"max_keys must be an int >= 1, got {max_keys!r}")
        self.rate, self.max_keys = float(rate), max_keys
        self._threshold = int(self.rate * _HASH_SPACE)
        self._last: dict[bytes, tuple[int, int, int]] = {}  #: sampled key -> (logical time, size, hash)
        self._times = _Fenwick(4 * max_keys)
        self._now = 0
        self.distances: dict[int, float] = {}  #: reuse distance (bytes, scaled by 1/rate) -> weight
        self.cold = 0.0  #: weight of first accesses (infinite distance)
        self.accesses = 0  #: accesses offered, sampled or not

    def access(self, key: bytes, size: int) -> None:
        self.accesses += 1
        h = _key_hash(key)
        if h >= self._threshold:
            return
        weight = 1.0 / self.rate
        seen = self._last.get(key)
        if seen is None:
            self.cold += weight
        else:
            t, old_size, _ = seen
            between = self._times.suffix(t)  # sizes of sampled keys accessed after this one's last access
            self._times.add(t, -old_size)
            distance = int(between / self.rate) + size  # the LRU stack down to and including this chunk
            self.distances[distance] = self.distances.get(distance, 0.0) + weight
        if self._now >= self._times.n:
            self._compact()
        self._last[key] = (self._now, size, h)
        self._times.add(self._now, size)
        self._now += 1
        if len(self._last) > self.max_keys:
            self._lower_rate()

    def _compact(self) -> None:
        """Renumber the live keys' times 0.. in order (times only grow; the tree has room for 4x max_keys)."""
        live = sorted(self._last.items(), key=lambda kv: kv[1][0])
        self._times = _Fenwick(self._times.n)
        for now, (key, (_, size, h)) in enumerate(live):
            self._last[key] = (now, size, h)
            self._times.add(now, size)
        self._now = len(live)

    def _lower_rate(self) -> None:
        """Halve the rate and forget the keys above the new threshold (SHARDS with a fixed number of keys)."""
        self.rate /= 2
        self._threshold //= 2
        for key, (t, size, h) in list(self._last.items()):
            if h >= self._threshold:
                self._times.add(t, -size)
                del self._last[key]

    def curve(self) -> "MissRatioCurve":
        """The miss-ratio curve so far, with SHARDS' adjustment: a spatial sample holds more or fewer accesses than
        ``rate`` of them (a popular key sampled or not swings it), and the difference is mostly hits to the hottest
        keys, so it is added at the smallest distance."""
        distances = dict(self.distances)
        sampled = self.cold + sum(distances.values())
        if sampled:
            distances[0] = distances.get(0, 0.0) + self.accesses - sampled
        return MissRatioCurve(distances, self.cold)


@dataclass(frozen=True)
class MissRatioCurve:
    distances: Mapping[int, float]  #: reuse distance in bytes -> weight (accesses it stands for)
    cold: float  #: weight of first accesses

    @property
    def total(self) -> float:
        return max(self.cold + sum(self.distances.values()), 0.0)

    def hit_ratio(self, capacity: float) -> float:
        """Fraction of accesses an LRU cache of ``capacity`` bytes would hit."""
        total = self.total
        if not total:
            return 0.0
        return min(max(sum(w for d, w in self.distances.items() if d <= capacity) / total, 0.0), 1.0)

    def ceiling(self) -> float:
        """The hit ratio of an infinite cache: every access but the first to each chunk."""
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
    cache: OrderedDict[bytes, int] = OrderedDict()
    used = hits = n = 0
    for key, size in accesses:
        n += 1
        if key in cache:
            hits += 1
            cache.move_to_end(key)
            continue
        cache[key] = size
        used += size
        while used > capacity and cache:
            _, evicted = cache.popitem(last=False)
            used -= evicted
    return hits / n if n else 0.0


ACCESS_LOG_ENV = "KVPOOL_ACCESS_LOG"  #: a directory: each process appends its sampled chunk lookups there
ACCESS_RATE_ENV = "KVPOOL_ACCESS_RATE"  #: the sampling rate (default 0.01)
FLUSH_EVERY = 1000  #: lines buffered before a write


class AccessLog:
    """A process's sampled chunk lookups, appended as JSON lines to ``<dir>/access-<host>-<pid>.jsonl`` for
    ``kvpool advise``: ``{"t": seconds, "key": hex, "size": bytes (0: not held, size unknown)}`` for each looked-up
    key whose hash falls in the sample, and ``{"t": seconds, "accesses": lookups so far, "rate": the sampling rate}`` with every write, so the
    advisor knows how many lookups the sample stands for.  The same hash threshold in every process makes the
    samples of all processes one spatial sample of the pool's whole lookup stream."""

    def __init__(self, directory: str, rate: float = 0.01) -> None:
        if not isinstance(rate, float) or not 0 < rate <= 1:
            raise ConfigError(f"{ACCESS_RATE_ENV} must be a number in (0, 1], got {rate!r}")
        if not os.path.isdir(directory):
            raise ConfigError(f"{ACCESS_LOG_ENV}={directory!r} is not a directory: create it, or unset the variable")
        self.path = os.path.join(directory, f"access-{socket.gethostname()}-{os.getpid()}.jsonl")
        self.rate, self._threshold = rate, int(rate * _HASH_SPACE)
        self._lines: list[str] = []
        self._accesses = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> "AccessLog | None":
        """The log the environment asks for (None: ``KVPOOL_ACCESS_LOG`` unset or empty)."""
        directory = os.environ.get(ACCESS_LOG_ENV, "")
        if not directory:
            return None
        raw = os.environ.get(ACCESS_RATE_ENV, "0.01")
        try:
            rate = float(raw)
        except ValueError:
            raise ConfigError(f"{ACCESS_RATE_ENV} must be a number in (0, 1], got {raw!r}") from None
        return cls(directory, rate)

    def record(self, keys: Sequence[bytes], size_of: Callable[[bytes], int]) -> None:
        """Count a lookup of ``keys``; log those in the sample with ``size_of(key)`` (0: not held)."""
        now = time.time()
        sampled = [k for k in keys if _key_hash(k) < self._threshold]
        lines = [json.dumps({"t": now, "key": k.hex(), "size": int(size_of(k))}) for k in sampled]
        with self._lock:
            self._accesses += len(keys)
            self._lines += lines
            if len(self._lines) >= FLUSH_EVERY:
                self._flush(now)

    def _flush(self, now: float) -> None:
        self._lines.append(json.dumps({"t": now, "accesses": self._accesses, "rate": self.rate}))
        with open(self.path, "a") as f:
            f.write("\n".join(self._lines) + "\n")
        self._lines = []

    def close(self) -> None:
        with self._lock:
            self._flush(time.time())


def read_access_logs(paths: Iterable[str]) -> tuple[float, list[tuple[bytes, int]], int]:
    """``(rate, sampled accesses in time order, lookups they stand for)`` of access logs written by
    :class:`AccessLog` (one rate for all: ``ConfigError`` otherwise).  A key logged with size 0 (looked up while
    not held) takes the size it was seen with elsewhere, or the median size seen."""
    rows: list[tuple[float, bytes, int]] = []
    total, rates = 0, set()
    for path in paths:
        last = 0
        try:
            with open(path) as f:
                for n, line in enumerate(f, 1):
                    try:
                        row = json.loads(line)
                        if "accesses" in row:
                            last = int(row["accesses"])
                            rates.add(float(row["rate"]))
                        else:
                            rows.append((float(row["t"]), bytes.fromhex(row["key"]), int(row["size"])))
                    except (ValueError, KeyError, TypeError) as exc:
                        raise ConfigError(
                            f"{path}:{n} is not an access-log line ({exc}): pass files written under KVPOOL_ACCESS_LOG"
                        ) from None
        except OSError as exc:
            raise ConfigError(f"cannot read access log {path}: {exc.strerror}") from None
        total += last
    if len(rates) > 1:
        raise ConfigError(f"the access logs were sampled at different rates {sorted(rates)}: pass logs of one rate")
    if not rows:
        raise ConfigError(
            "the access logs hold no sampled lookup: let the engines run longer, or raise KVPOOL_ACCESS_RATE"
        )
    rows.sort(key=lambda r: r[0])
    sizes = {key: size for _, key, size in rows if size}
    typical = int(statistics.median(sizes.values())) if sizes else 1
    return rates.pop() if rates else 1.0, [(key, size or sizes.get(key, typical)) for _, key, size in rows], total


def curve_of_log(rate: float, accesses: Sequence[tuple[bytes, int]], total: int) -> MissRatioCurve:
    """The miss-ratio curve of an access log's sample (``total``: the lookups it stands for)."""
    sampler = ReuseSampler(rate, max_keys=max(1, len({key for key, _ in accesses})))
    for key, size in accesses:
        sampler.access(key, size)
    sampler.accesses = max(total, sampler.accesses)
    return sampler.curve()
