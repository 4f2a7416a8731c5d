"""Chunk events: what changed in the pool — a chunk stored on a node, removed from one, moved between its tiers —
derived from etcd's watch of the placements, so that nothing is missed and a consumer resumes from a revision.

Every replica is one etcd key bound to its holder's lease (``/kvpool/<cluster>/chunks/<key>/<node>``), so every
change to the pool's contents is an etcd event, in revision order: a put publishes a key (``stored``), a demotion
or promotion rewrites it with another tier (``moved``), a remove, an eviction or the holder's lease running out
(the node died) deletes it (``removed``).  The watch asks for each event's previous value, so a removal says which
tier it left and a rewrite can be told from a first store without any state kept here.  Every event names the
fingerprint of the cache identity the chunk was put under, as its placement records it (so a router keeps to the
caches it serves; "" when the writer gave none, or a removal etcd had no previous value for).

:class:`EventStream` yields them in batches: first, unless it resumes after a revision, the pool's contents as
``stored`` events at the snapshot's revision; then every change.  A consumer that keeps the last revision it has
seen resumes after it with no gap and no repeat, as long as etcd still holds that history (it keeps it until
compaction; an older revision is a ``MetadataUnavailable`` — start again from a snapshot).
"""

import enum
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvpool.core.types import Placement, Tier
from kvpool.errors import MalformedRecord, MetadataUnavailable
from kvpool.metadata.client import EtcdClient, WatchStream
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import decode_placement

_DELETE = 1  #: mvccpb.Event.EventType.DELETE


class EventKind(enum.Enum):
    STORED = "stored"  #: a replica appeared on ``node`` in ``tier``
    REMOVED = "removed"  #: the replica on ``node`` is gone (removed, evicted, or its node left the pool)
    MOVED = "moved"  #: the replica on ``node`` went from ``was`` to ``tier`` (demoted to NVMe, promoted to DRAM)


@dataclass(frozen=True)
class ChunkEvent:
    kind: EventKind
    revision: int  #: the etcd revision of the change (of the snapshot, for the contents a stream starts with)
    key: bytes  #: the chunk key
    node: str  #: the holder: a node id, or the remote tier's name
    tier: Tier | None  #: where the replica is now (``removed``: where it was; None if etcd no longer knew)
    size: int = 0  #: bytes of the chunk (0 when not known: a removal etcd gave no previous value for)
    was: Tier | None = None  #: ``moved``: the tier it left
    identity: str = ""  #: fingerprint of the cache identity it was put under ("": not known)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind.value,
            "revision": self.revision,
            "key": self.key.hex(),
            "node": self.node,
            "tier": self.tier.value if self.tier else None,
            "size": self.size,
            "identity": self.identity,
        }
        if self.was is not None:
            out["was"] = self.was.value
        return out


def _placement(ns: Namespace, kv: Any) -> Placement | None:
    """The placement a watched key-value holds (None: no value, or not a placement)."""
    if not kv.key or not kv.value:
        return None
    try:
        chunk, node = ns.parse_replica(kv.key)
        return decode_placement(chunk, node, kv.value)
    except MalformedRecord:
        return None


def _of(kind: EventKind, revision: int, p: Placement, was: Tier | None = None) -> ChunkEvent:
    """Event ``kind`` at ``revision`` of the replica placement ``p`` describes."""
    return ChunkEvent(kind, revision, p.key, p.node, p.tier, p.size, was, p.identity)


def classify(ns: Namespace, event: Any) -> ChunkEvent | None:
    """The chunk event an etcd watch event (with its previous value) stands for; None for a key that is not a
    placement, or a rewrite that left the replica in the same tier."""
    try:
        key, node = ns.parse_replica(event.kv.key)
    except MalformedRecord:
        return None
    revision = int(event.kv.mod_revision)
    before = _placement(ns, event.prev_kv)
    if event.type == _DELETE:
        if before is None:  # no previous value (compacted away): only which replica went is known
            return ChunkEvent(EventKind.REMOVED, revision, key, node, None)
        return _of(EventKind.REMOVED, revision, before)
    now = _placement(ns, event.kv)
    if now is None:
        return None
    if before is None:
        return _of(EventKind.STORED, revision, now)
    if before.tier is not now.tier:
        return _of(EventKind.MOVED, revision, now, was=before.tier)
    return None


class EventStream:
    """The chunk events of cluster ``namespace``: iterate for ``(revision, events)`` batches, in revision order;
    :meth:`cancel` from any thread ends the iteration.

    ``after``: resume after this revision (None: start with the pool's contents as ``stored`` events).
    ``until``: stop once the stream has reached this revision (None: follow until cancelled).  A batch may be
    empty: it still says the stream has reached ``revision`` (the cluster's other keys move it on)."""

    def __init__(self, etcd: EtcdClient, namespace: Namespace, *, after: int | None = None, until: int | None = None):
        self.etcd, self.namespace, self.after, self.until = etcd, namespace, after, until
        self._watch: WatchStream | None = None
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()
        if self._watch is not None:
            self._watch.cancel()

    def __iter__(self) -> Iterator[tuple[int, list[ChunkEvent]]]:
        ns, revision = self.namespace, self.after
        if revision is None:
            revision, kvs = self.etcd.snapshot(ns.chunks)
            held = [p for p in (_placement(ns, kv) for kv in kvs) if p is not None]
            yield revision, [_of(EventKind.STORED, revision, p) for p in held]
        if self.until is not None and revision >= self.until:
            return
        self._watch = self.etcd.watch(ns.root, revision + 1, prev_kv=True)  # root: the sync marker moves it on
        if self._cancelled.is_set():
            self._watch.cancel()
        try:
            for resp in self._watch:
                if not resp.events:
                    continue
                revision = int(resp.events[-1].kv.mod_revision)
                yield revision, [e for e in (classify(ns, ev) for ev in resp.events) if e is not None]
                if self.until is not None and revision >= self.until:
                    self._watch.cancel()
                    return
        except MetadataUnavailable as exc:
            if "compacted" not in str(exc):
                raise
            raise MetadataUnavailable(
                f"the changes after revision {revision} are no longer in etcd's history ({exc}): start again from "
                "the pool's contents (kvpool events without --after)"
            ) from None


def replay(events: Iterator[ChunkEvent] | list[ChunkEvent], into: dict[tuple[bytes, str], Tier | None]) -> None:
    """Apply ``events`` to ``into`` (``(key, node) -> tier``): what a consumer that rebuilds the pool's contents
    from events alone holds.  ``MetadataUnavailable`` for an event that contradicts it (a gap in the stream)."""
    for e in events:
        where = (e.key, e.node)
        if e.kind is EventKind.REMOVED:
            if into.pop(where, "gone") == "gone":
                raise MetadataUnavailable(f"event stream gap: {e.key.hex()[:16]} removed from {e.node} it never held")
        elif e.kind is EventKind.MOVED and where not in into:
            raise MetadataUnavailable(f"event stream gap: {e.key.hex()[:16]} moved on {e.node} it never held")
        else:
            into[where] = e.tier
