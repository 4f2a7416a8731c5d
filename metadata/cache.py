"""A local copy of a cluster's metadata, kept in sync by an etcd watch.

Snapshot (paged, at one revision), then watch from ``revision + 1``: no event between the two is
missed.  Lookups (longest cached prefix, replicas of a chunk, live nodes) are answered from memory
without an etcd round trip.  When the watch breaks (etcd died, restarted, or compacted past us) the
cache keeps serving what it had, marks itself unsynced, and rebuilds from a fresh snapshot as soon as
etcd answers: entries deleted meanwhile (a node's lease expired, etcd restarted empty) do not survive.
"""

import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.core.types import Departure, IdentityRecord, NodeRecord, Placement, Tier, Tombstone
from kvpool.errors import MalformedRecord, MetadataUnavailable
from kvpool.metadata.client import EtcdClient, KeyValue, WatchStream
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import (
    decode_departure,
    decode_identity,
    decode_node,
    decode_placement,
    decode_tombstone,
)

log = logging.getLogger(__name__)

_PUT, _DELETE = 0, 1  # mvccpb.Event.EventType
LEFT_KEPT = 100_000  #: replicas seen leaving with their node, remembered for miss causes (oldest forgotten first)


@dataclass
class _State:
    """What a snapshot holds, by kind of record."""

    chunks: dict[bytes, dict[str, Placement]] = field(default_factory=dict)
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    identities: dict[str, IdentityRecord] = field(default_factory=dict)  #: by fingerprint
    tombstones: dict[bytes, dict[str, Tombstone]] = field(default_factory=dict)
    departures: dict[str, Departure] = field(default_factory=dict)


class MetadataCache:
    def __init__(self, etcd: EtcdClient, namespace: Namespace) -> None:
        self.etcd = etcd
        self.namespace = namespace
        self._cond = threading.Condition()
        self._state = _State()
        #: replicas deleted at the revision their node's record was: ``key -> (node, tier, revision)``
        self._left: OrderedDict[bytes, tuple[str, Tier, int]] = OrderedDict()
        self._revision = 0  #: every event up to here has been applied
        self._synced = False
        self._stop = threading.Event()
        self._watch: WatchStream | None = None
        self._thread: threading.Thread | None = None
        self.resyncs = 0  #: snapshots taken (1 + one per broken watch)
        self.malformed = 0  #: values skipped because they could not be decoded

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> "MetadataCache":
        """Take the first snapshot here (``MetadataUnavailable`` if etcd cannot be reached), then keep
        in sync from a background thread."""
        self._reset(*self.etcd.snapshot(self.namespace.root))
        self._thread = threading.Thread(target=self._run, name="kvpool-metadata-cache", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> "MetadataCache":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            try:
                if not self._synced:
                    self._reset(*self.etcd.snapshot(self.namespace.root))
                    delay = 0.05
                self._watch = self.etcd.watch(self.namespace.root, self._revision + 1)
                if self._stop.is_set():
                    self._watch.cancel()
                for resp in self._watch:
                    self._apply(resp)
            except MetadataUnavailable as exc:
                if self._stop.is_set():
                    break
                with self._cond:
                    self._synced = False
                log.warning("metadata cache out of sync (%s); re-snapshot in %.2f s", exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 1.0)
            except Exception:
                log.exception("metadata cache sync step failed; retrying")
                with self._cond:
                    self._synced = False
                self._stop.wait(delay)

    # -- applying snapshots and events --------------------------------------------------------------

    def _reset(self, revision: int, kvs: list[KeyValue]) -> None:
        self.malformed = 0  # recounted from the snapshot
        state = _State()
        for kv in kvs:
            self._put(state, kv.key, kv.value)
        with self._cond:
            self._state = state
            self._revision, self._synced = revision, True
            self.resyncs += 1
            self._cond.notify_all()

    def _apply(self, resp: Any) -> None:
        ns = self.namespace
        left = {ev.kv.key for ev in resp.events if ev.type == _DELETE and ev.kv.key.startswith(ns.nodes)}
        with self._cond:
            for ev in resp.events:
                if ev.type == _DELETE:
                    self._delete(ev.kv.key, ev.kv.mod_revision, left)
                else:
                    self._put(self._state, ev.kv.key, ev.kv.value)
            if resp.events:  # events arrive in revision order: everything up to the last one is applied
                self._revision = max(self._revision, resp.events[-1].kv.mod_revision)
                self._cond.notify_all()

    def _put(self, state: _State, key: bytes, value: bytes) -> None:
        ns = self.namespace
        try:
            if key.startswith(ns.chunks):
                chunk, node = ns.parse_replica(key)
                state.chunks.setdefault(chunk, {})[node] = decode_placement(chunk, node, value)
            elif key.startswith(ns.nodes):
                node_id = ns.parse_node(key)
                state.nodes[node_id] = decode_node(node_id, value)
            elif key.startswith(ns.identities):
                state.identities[ns.parse_identity(key)] = decode_identity(value)
            elif key.startswith(ns.gone):
                chunk, node = ns.parse_tombstone(key)
                state.tombstones.setdefault(chunk, {})[node] = decode_tombstone(chunk, node, value)
            elif key.startswith(ns.departed):
                node_id = ns.parse_departure(key)
                state.departures[node_id] = decode_departure(node_id, value)
        except (MalformedRecord, ValueError) as exc:
            self.malformed += 1
            log.warning("metadata cache: skipping %s: %s", key.decode(errors="replace"), exc)

    def _delete(self, key: bytes, revision: int, left: set[bytes]) -> None:
        """Forget ``key``; a replica deleted with its node's record (``left``: the node keys deleted by the same
        response) is remembered as gone with its node."""
        ns, state = self.namespace, self._state
        try:
            if key.startswith(ns.chunks):
                chunk, node = ns.parse_replica(key)
                replicas = state.chunks.get(chunk)
                if replicas is not None:
                    gone = replicas.pop(node, None)
                    if not replicas:
                        del state.chunks[chunk]
                    if gone is not None and ns.node(node) in left:
                        self._left[chunk] = (node, gone.tier, revision)
                        if len(self._left) > LEFT_KEPT:
                            self._left.popitem(last=False)
            elif key.startswith(ns.nodes):
                state.nodes.pop(ns.parse_node(key), None)
            elif key.startswith(ns.identities):
                state.identities.pop(ns.parse_identity(key), None)
            elif key.startswith(ns.gone):
                chunk, node = ns.parse_tombstone(key)
                stones = state.tombstones.get(chunk, {})
                stones.pop(node, None)
                if not stones:
                    state.tombstones.pop(chunk, None)
            elif key.startswith(ns.departed):
                state.departures.pop(ns.parse_departure(key), None)
        except MalformedRecord:
            pass  # a key we never decoded

    # -- queries --------------------------------------------------------------------------------------

    @property
    def revision(self) -> int:
        return self._revision

    def sync(self, timeout_s: float = 5.0) -> int:
        """Wait until every write made to etcd before this call is visible here; return that revision.

        The read-your-writes barrier: after a publish, ``cache.sync()`` then a lookup sees it.  It writes
        the cluster's sync marker and waits for the watch to deliver that write; events arrive in
        revision order, so everything before it has been applied.  (etcd's progress notifications
        cannot serve here: before 3.5.8 they may overtake events still queued for the watcher.)
        """
        target = self.etcd.put(self.namespace.sync_marker, uuid.uuid4().bytes)
        with self._cond:
            if not self._cond.wait_for(lambda: self._synced and self._revision >= target, timeout=timeout_s):
                raise MetadataUnavailable(
                    f"metadata cache did not reach revision {target} in {timeout_s} s (at {self._revision}); "
                    "its watch on etcd is broken or slow"
                )
        return target

    def wait_until(self, predicate: Callable[["MetadataCache"], bool], timeout_s: float) -> bool:
        """Block until ``predicate(self)`` holds, re-checking on every applied change (no polling)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout=timeout_s)

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks of ``keys`` have at least one known replica."""
        held = 0
        with self._cond:
            for k in keys:
                if k not in self._state.chunks:
                    break
                held += 1
        return held

    def chunks(self) -> list[tuple[bytes, list[Placement]]]:
        """Every chunk with its replicas."""
        with self._cond:
            return [(key, list(replicas.values())) for key, replicas in self._state.chunks.items()]

    def replicas(self, key: bytes) -> list[Placement]:
        with self._cond:
            return list(self._state.chunks.get(key, {}).values())

    def size_of(self, key: bytes) -> int:
        """Bytes of chunk ``key`` as its replicas say (0: not held)."""
        with self._cond:
            return max((p.size for p in self._state.chunks.get(key, {}).values()), default=0)

    def nodes(self) -> list[NodeRecord]:
        with self._cond:
            return sorted(self._state.nodes.values(), key=lambda n: n.node_id)

    def identities(self) -> dict[str, IdentityRecord]:
        """The cache identities clients registered, by fingerprint."""
        with self._cond:
            return dict(self._state.identities)

    def tombstones(self, key: bytes) -> list[Tombstone]:
        """Why nodes dropped chunk ``key``, as long as the tombstones last (newest first)."""
        with self._cond:
            return sorted(self._state.tombstones.get(key, {}).values(), key=lambda t: -t.at)

    def departures(self) -> dict[str, Departure]:
        """Nodes that left the pool lately, by node id (as long as their records last)."""
        with self._cond:
            return dict(self._state.departures)

    def left_with_node(self, key: bytes) -> tuple[str, Tier, int] | None:
        """``(node, tier, revision)`` when this cache saw chunk ``key``'s last replica go with its node."""
        with self._cond:
            return self._left.get(key)

    def chunk_count(self) -> int:
        with self._cond:
            return len(self._state.chunks)

    def bytes_held(self, node_id: str, tier: Tier) -> int:
        """Bytes of the replicas ``node_id`` holds in ``tier``, from the placements (always current)."""
        with self._cond:
            return sum(p.stored for r in self._state.chunks.values() if (p := r.get(node_id)) and p.tier is tier)

    def replica_count(self, node_id: str | None = None) -> int:
        with self._cond:
            if node_id is None:
                return sum(len(r) for r in self._state.chunks.values())
            return sum(1 for r in self._state.chunks.values() if node_id in r)
