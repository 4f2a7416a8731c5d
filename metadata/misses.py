"""Why a chunk is not in the pool: the cause of every miss, from what etcd still knows.

For a chunk some object of which has no replica, in this order:

1. a **tombstone** (:mod:`kvpool.metadata.tombstones`): a node evicted it (from which tier, by which policy),
   it was removed, or its bytes failed their checksum and it was dropped as corrupt — the newest one says;
2. it **left with its node**: a watch cache saw its last replica deleted with its node's record, or (for a cache
   that started later) a node recorded as departed held it in etcd's history the revision before it left;
3. it is stored under **another cache identity** of the same model (another dtype, layout, chunk size, TP or
   codec): the same tokens hash to other keys, and those are held;
4. else it was **never stored** (or its tombstone has expired, or etcd's history was compacted).

A fifth cause is counted where it happens rather than found afterwards: a chunk that was there but whose **read
failed** (a timeout or refusal while reading: the reload fell back to recomputing).

:func:`miss_cause` answers from a watch cache alone (for the ``kvpool_misses_total{cause}`` metric);
:func:`explain` adds etcd's history and the other identities, for ``kvpool explain``.
"""

import enum
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvpool.core.keys import CacheIdentity, chunk_keys, layer_key
from kvpool.core.types import DropCause, Placement, Tombstone
from kvpool.errors import MalformedRecord, MetadataUnavailable
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.identities import fingerprint
from kvpool.metadata.records import decode_placement


class MissCause(enum.Enum):
    NEVER_STORED = "never_stored"
    EVICTED = "evicted"
    REMOVED = "removed"
    CORRUPT = "corrupt"
    NODE_LEFT = "node_left"
    READ_FAILED = "read_failed"
    OTHER_IDENTITY = "other_identity"


MISS_CAUSES = tuple(c.value for c in MissCause)  #: the ``cause`` label values of ``kvpool_misses_total``
_OF_DROP = {
    DropCause.EVICTED: MissCause.EVICTED,
    DropCause.REMOVED: MissCause.REMOVED,
    DropCause.CORRUPT: MissCause.CORRUPT,
}
_GROUPED = re.compile(r"^[\w-]+:\[T,(?:(\d+|L),)?2,H,D\] L=(\d+) ")


def objects_per_chunk(layout: str) -> int:
    """How many pool objects a chunk of an identity with this ``layout`` string is stored as: from the layouts of
    :class:`~kvpool.prefill_decode.reference.layout.KVLayout` (``per-layer``, ``groups-of-G``, ``all-layers``); vLLM's
    (one object per layer, the layer count not in the string) and others count one, the first."""
    m = _GROUPED.match(layout)
    if m is None:
        return 1
    group, layers = m.groups()
    return 1 if group == "L" else int(layers) // int(group or 1)


def object_keys(identity: CacheIdentity, chunk_key: bytes) -> list[bytes]:
    """The pool objects of one chunk under ``identity`` (for vLLM's layouts: layer 0's, standing for the chunk)."""
    if identity.layout.startswith("vllm-"):
        return [layer_key(chunk_key, 0)]
    groups = objects_per_chunk(identity.layout)
    return [chunk_key] if groups == 1 else [layer_key(chunk_key, g) for g in range(groups)]


def miss_cause(cache: MetadataCache, keys: Sequence[bytes]) -> tuple[MissCause, str]:
    """Why the chunk of objects ``keys`` is missing, from ``cache`` alone: ``(cause, what the evidence says)``."""
    for key in keys:
        if cache.replicas(key):
            continue
        stones = cache.tombstones(key)
        if stones:
            return _OF_DROP[stones[0].cause], _said(stones[0])
        left = cache.left_with_node(key)
        if left is not None:
            node, tier, revision = left
            return MissCause.NODE_LEFT, f"its node {node} left (etcd revision {revision}); it was in {tier.value}"
        return MissCause.NEVER_STORED, "no replica, tombstone or departed node knows it"
    return MissCause.NEVER_STORED, "every object is held"  # not missing: callers ask about missing chunks only


def _said(t: Tombstone) -> str:
    ago = max(0.0, time.time() - t.at)
    when = f"{time.strftime('%H:%M:%S', time.localtime(t.at))} ({ago:.0f} s ago)"
    if t.cause is DropCause.EVICTED:
        return f"evicted from {t.tier.value} on node {t.node} by {t.policy or 'the eviction policy'} at {when}"
    if t.cause is DropCause.CORRUPT:
        return f"dropped from {t.tier.value} on node {t.node} as corrupt (checksum mismatch) at {when}"
    return f"removed from {t.tier.value} on node {t.node} at {when}"


@dataclass(frozen=True)
class ChunkStatus:
    """One chunk of a prompt: held (where), or why not."""

    index: int
    first_token: int
    end_token: int
    key: bytes  #: the chunk key (its first object's key under a layered layout is derived from it)
    held: tuple[Placement, ...]  #: the replicas of its first object, nearest tier first (empty: missing)
    cause: MissCause | None  #: None: every object is held
    detail: str

    def as_json(self) -> dict[str, object]:
        out = asdict(self)
        out["key"] = self.key.hex()
        out["cause"] = self.cause.value if self.cause else None
        out["held"] = [{"node": p.node, "tier": p.tier.value, "size": p.size} for p in self.held]
        return out


def explain(
    cache: MetadataCache, etcd: EtcdClient, identity: CacheIdentity, tokens: Sequence[int]
) -> list[ChunkStatus]:
    """Every full chunk of ``tokens`` under ``identity``: where it is, or why not (see the module)."""
    chain = chunk_keys(identity, tokens)
    size = identity.chunk_size
    others = [
        r.identity for r in cache.identities().values() if r.identity.model == identity.model and r.identity != identity
    ]
    other_chains = {fingerprint(o): (o, chunk_keys(o, tokens)) for o in others if o.chunk_size == size}
    out = []
    for i, key in enumerate(chain):
        objects = object_keys(identity, key)
        held = tuple(sorted(cache.replicas(objects[0]), key=lambda p: p.tier.rank))
        missing = [k for k in objects if not cache.replicas(k)]
        if not missing:
            where = ", ".join(f"{p.tier.value}@{p.node}" for p in held)
            out.append(ChunkStatus(i, i * size, (i + 1) * size, key, held, None, f"held: {where}"))
            continue
        cause, detail = miss_cause(cache, missing)
        if cause is MissCause.NEVER_STORED:
            cause, detail = (
                _from_history(cache, etcd, missing)
                or _other_identity(cache, identity, other_chains, i)
                or (cause, detail)
            )
        out.append(ChunkStatus(i, i * size, (i + 1) * size, key, held, cause, detail))
    return out


def _from_history(cache: MetadataCache, etcd: EtcdClient, keys: Sequence[bytes]) -> tuple[MissCause, str] | None:
    """A departed node that held one of ``keys`` the revision before it left, by etcd's history."""
    ns = cache.namespace
    for d in sorted(cache.departures().values(), key=lambda d: -d.revision):
        for key in keys:
            try:
                kv = etcd.get(ns.replica(key, d.node), revision=d.revision - 1)
            except MetadataUnavailable as exc:
                return MissCause.NODE_LEFT, (
                    f"unknown: node {d.node} left at etcd revision {d.revision}, but etcd no longer has the history "
                    f"to say whether it held this chunk ({exc})"
                )
            if kv is None:
                continue
            try:
                tier = decode_placement(key, d.node, kv.value).tier.value
            except MalformedRecord:
                tier = "?"
            when = time.strftime("%H:%M:%S", time.localtime(d.at))
            return (
                MissCause.NODE_LEFT,
                f"its node {d.node} left at {when} (etcd revision {d.revision}); it was in {tier}",
            )
    return None


def _other_identity(
    cache: MetadataCache, identity: CacheIdentity, others: dict[str, tuple[CacheIdentity, list[bytes]]], index: int
) -> tuple[MissCause, str] | None:
    """Another registered identity of the model under which this chunk of the prompt is held."""
    for name, (other, chain) in sorted(others.items()):
        if index < len(chain) and all(cache.replicas(k) for k in object_keys(other, chain[index])):
            differ = [
                f"{f}: {getattr(other, f)} here vs {getattr(identity, f)} asked"
                for f in ("kv_dtype", "layout", "chunk_size", "tp_size", "tp_rank", "codec")
                if getattr(other, f) != getattr(identity, f)
            ]
            return MissCause.OTHER_IDENTITY, f"held under identity {name}, which differs in {'; '.join(differ)}"
    return None
