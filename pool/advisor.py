"""Capacity advice from the chunk lookups clients log: the access log each client writes (``KVPOOL_ACCESS_LOG``),
reading the logs back, and the miss-ratio curve of what they hold (the model itself: :mod:`kvpool.pool.reuse`).

A log line is one lookup, in chain order, from one process on one node; lookups are kept whole because a prefix
lookup reuses only the leading chunks the pool holds (the prefix rule needs each lookup's order), and the node is
kept because each node is its own LRU stack (a chunk lives on the node of the client that put it).
"""

import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec
from msgspec import Meta

from kvpool.core.config import Finite, NonNegative, checked, validated
from kvpool.errors import ConfigError, SetupError
from kvpool.pool.config import Watermarks
from kvpool.pool.reuse import (
    MissRatioCurve,
    ReuseSampler,
    TierHits,
    key_hash,
    lru_hit_ratio,
    prefix_lru_hit_ratio,
    threshold,
    tier_hits,
)

__all__ = [
    "ACCESS_LOG_ENV",
    "ACCESS_RATE_ENV",
    "AccessLog",
    "AccessSample",
    "MissRatioCurve",
    "ReuseSampler",
    "TierHits",
    "curve_of_log",
    "lru_hit_ratio",
    "prefix_lru_hit_ratio",
    "read_access_logs",
    "tier_hits",
    "usable_bytes",
]

ACCESS_LOG_ENV = "KVPOOL_ACCESS_LOG"  #: a directory: each process appends its sampled chunk lookups there
ACCESS_RATE_ENV = "KVPOOL_ACCESS_RATE"  #: the sampling rate (default 0.01)
FLUSH_EVERY = 1000  #: sampled keys buffered before a write


def _this_node() -> str:
    """The Ray node this process runs on (where its puts land: a client puts to its own node), else the host."""
    import ray  # imported here: reading logs (kvpool advise) needs no Ray

    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else socket.gethostname()


_Rate = Annotated[float, Meta(gt=0, le=1, description=f"a number in (0, 1] ({ACCESS_RATE_ENV})")]


class AccessLog:
    """A process's sampled chunk lookups, appended as JSON lines to ``<dir>/access-<host>-<pid>.jsonl`` for
    ``kvpool advise``: ``{"t": seconds, "keys": [hex, ...], "sizes": [bytes, ...]}`` per lookup with a key in the
    sample (its sampled keys in chain order; size 0: not held, size unknown), and with every write
    ``{"t": seconds, "accesses": keys looked up so far, "lookups": lookups so far, "rate": the sampling rate,
    "node": the node this process's puts land on}``, so the advisor knows how many
    lookups the sample stands for and whose stack each key joins.  The same hash threshold in every process makes
    the samples of all processes one spatial sample of the pool's whole lookup stream.  (Logs written before the
    lookup lines, ``{"t", "key", "size"}`` per key, are read as one-key lookups on an unknown node.)"""

    @checked
    def __init__(self, directory: str, rate: _Rate = 0.01) -> None:
        if not os.path.isdir(directory):
            raise SetupError(f"{ACCESS_LOG_ENV}={directory!r} is not a directory: create it, or unset the variable")
        self.path = os.path.join(directory, f"access-{socket.gethostname()}-{os.getpid()}.jsonl")
        self.rate, self._threshold = rate, threshold(rate)
        self.node = _this_node()
        self._lines: list[str] = []
        self._buffered = self._accesses = self._lookups = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> "AccessLog | None":
        """The log the environment asks for (None: ``KVPOOL_ACCESS_LOG`` unset or empty)."""
        directory = os.environ.get(ACCESS_LOG_ENV, "")
        if not directory:
            return None
        return cls(directory, validated(_Rate, os.environ.get(ACCESS_RATE_ENV, "0.01"), ACCESS_RATE_ENV, strict=False))

    def record(self, keys: Sequence[bytes], size_of: Callable[[bytes], int]) -> None:
        """Count a lookup of ``keys`` (in chain order); log those in the sample with ``size_of(key)`` (0: not held)."""
        now = time.time()
        sampled = [k for k in keys if key_hash(k) < self._threshold]
        line = ""
        if sampled:
            line = json.dumps(
                {"t": now, "keys": [k.hex() for k in sampled], "sizes": [int(size_of(k)) for k in sampled]}
            )
        with self._lock:
            self._accesses += len(keys)
            self._lookups += 1
            if line:
                self._lines.append(line)
                self._buffered += len(sampled)
            if self._buffered >= FLUSH_EVERY:
                self._flush(now)

    def _flush(self, now: float) -> None:
        self._lines.append(
            json.dumps(
                {"t": now, "accesses": self._accesses, "lookups": self._lookups, "rate": self.rate, "node": self.node}
            )
        )
        with open(self.path, "a") as f:
            f.write("\n".join(self._lines) + "\n")
        self._lines, self._buffered = [], 0

    def close(self) -> None:
        with self._lock:
            self._flush(time.time())


@dataclass(frozen=True)
class AccessSample:
    """What a set of access logs holds: the sampled lookups in time order, as ``(node, [(key, size), ...])``."""

    rate: float
    lookups: list[tuple[str, list[tuple[bytes, int]]]]
    unheld: list[frozenset[int]]  #: per lookup, the positions of the keys it found not held (logged with size 0)
    total: int  #: the key lookups the sample stands for
    nodes: tuple[str, ...]  #: the nodes the logging processes ran on ("": a log that did not say)

    @property
    def accesses(self) -> list[tuple[bytes, int]]:
        return [item for _, items in self.lookups for item in items]


_Hex = Annotated[str, Meta(pattern=r"^([0-9a-fA-F]{2})+\Z", description="a chunk key's hex digits")]


class _Totals(msgspec.Struct):
    """A log's running totals, written with every flush."""

    accesses: NonNegative
    rate: Annotated[float, Meta(gt=0, le=1, description="a sampling rate in (0, 1]")]
    node: str = ""


class _Lookup(msgspec.Struct):
    """One sampled lookup: its keys in chain order and their sizes (0: not held)."""

    t: Finite
    keys: list[_Hex]
    sizes: list[NonNegative]


class _KeyLine(msgspec.Struct):
    """One sampled key, as logs written before lookups were kept whole hold them."""

    t: Finite
    key: _Hex
    size: NonNegative


def _read(path: str) -> tuple[list[tuple[float, list[tuple[bytes, int]]]], int, set[float], str]:
    """One log's ``(lookups with their time, key lookups counted, {rate}, node)``."""
    rows: list[tuple[float, list[tuple[bytes, int]]]] = []
    last, rates, node = 0, set(), ""
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                where = f"{path}:{n} is not an access-log line (pass files written under KVPOOL_ACCESS_LOG)"
                try:
                    row = json.loads(line)
                    kind = _Totals if "accesses" in row else _Lookup if "keys" in row else _KeyLine
                    entry = validated(kind, row, where)
                    if isinstance(entry, _Totals):
                        last, node = entry.accesses, entry.node
                        rates.add(entry.rate)
                    elif isinstance(entry, _Lookup):
                        if len(entry.keys) != len(entry.sizes):
                            raise ConfigError(f"{where}: {len(entry.keys)} keys but {len(entry.sizes)} sizes")
                        rows.append(
                            (entry.t, [(bytes.fromhex(k), s) for k, s in zip(entry.keys, entry.sizes, strict=True)])
                        )
                    else:  # each key its own lookup
                        rows.append((entry.t, [(bytes.fromhex(entry.key), entry.size)]))
                except ConfigError:  # validated(): the field and what it must be
                    raise
                except (ValueError, TypeError) as exc:  # not JSON, not an object
                    raise ConfigError(f"{where}: {exc}") from None
    except OSError as exc:
        raise SetupError(f"cannot read access log {path}: {exc.strerror}") from None
    return rows, last, rates, node


def read_access_logs(paths: Iterable[str]) -> AccessSample:
    """The sample of access logs written by :class:`AccessLog` (one rate for all: ``ConfigError`` otherwise).  A key
    logged with size 0 (looked up while not held) takes the size it was seen with elsewhere, or the median size."""
    rows: list[tuple[float, str, list[tuple[bytes, int]]]] = []
    total, rates, nodes = 0, set[float](), set[str]()
    for path in paths:
        timed, last, seen, node = _read(path)
        rows += [(t, node, items) for t, items in timed]
        total, rates, nodes = total + last, rates | seen, nodes | {node}
    if len(rates) > 1:
        raise ConfigError(f"the access logs were sampled at different rates {sorted(rates)}: pass logs of one rate")
    if not rows:
        raise ConfigError(
            "the access logs hold no sampled lookup: let the engines run longer, or raise KVPOOL_ACCESS_RATE"
        )
    rows.sort(key=lambda r: r[0])
    sizes = {key: size for _, _, items in rows for key, size in items if size}
    typical = int(statistics.median(sizes.values())) if sizes else 1
    lookups = [(node, [(key, size or sizes.get(key, typical)) for key, size in items]) for _, node, items in rows]
    unheld = [frozenset(j for j, (_, size) in enumerate(items) if not size) for _, _, items in rows]
    return AccessSample(rates.pop() if rates else 1.0, lookups, unheld, total, tuple(sorted(nodes)))


def curve_of_log(
    log: AccessSample, per_node: bool = True, prefix: bool = True, logged_at: float = 0.0
) -> MissRatioCurve:
    """The miss-ratio curve of an access log's sample: per-node stacks (when the logs name their nodes and
    ``per_node``) with the prefix rule (unless not ``prefix``: each object a hit or a miss on its own).
    ``logged_at``: the pool's capacity when the logs were written (bytes that hold chunks, all nodes; 0: unknown),
    so that keys the lookups found not held within it count as missing at every capacity (being written by a
    concurrent lookup, see :class:`ReuseSampler`)."""
    keys = len({key for _, items in log.lookups for key, _ in items})
    stacks = len(log.nodes) if per_node else 1
    sampler = ReuseSampler(log.rate, max_keys=max(1, keys), per_node=per_node, logged_at=logged_at / max(1, stacks))
    for (node, items), unheld in zip(log.lookups, log.unheld, strict=True):
        if prefix:
            sampler.lookup(items, node, unheld)
        else:
            for j, item in enumerate(items):
                sampler.lookup([item], node, {0} if j in unheld else ())
    sampler.accesses = max(log.total, sampler.accesses)
    return sampler.curve()


def usable_bytes(dram: float, nvme: float, watermarks: Watermarks | None = None) -> tuple[float, float]:
    """``(DRAM, NVMe)`` bytes that hold chunks on average, of segments of ``dram`` and ``nvme`` bytes: a node with
    an NVMe tier keeps DRAM between its watermarks (demoting from ``high`` down to ``low``), so DRAM holds
    ``(low + high) / 2`` of its bytes on average; NVMe, and DRAM alone, fill to the brim before they evict."""
    marks = watermarks or Watermarks()
    return (dram * (marks.low + marks.high) / 2 if nvme > 0 else dram), nvme
