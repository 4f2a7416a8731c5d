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
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.errors import MalformedRecord, MetadataUnavailable
from kvpool.metadata.client import EtcdClient, KeyValue, WatchStream
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import decode_identity, decode_node, decode_placement
from kvpool.pool.types import IdentityRecord, NodeRecord, Placement, Tier

log = logging.getLogger(__name__)

_PUT, _DELETE = 0, 1  # mvccpb.Event.EventType


class MetadataCache:
    def __init__(self, etcd: EtcdClient, namespace: Namespace) -> None:
        self.etcd = etcd
        self.namespace = namespace
        self._cond = threading.Condition()
        self._chunks: dict[bytes, dict[str, Placement]] = {}
        self._nodes: dict[str, NodeRecord] = {}
        self._identities: dict[str, IdentityRecord] = {}  #: by fingerprint
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
        chunks: dict[bytes, dict[str, Placement]] = {}
        nodes: dict[str, NodeRecord] = {}
        identities: dict[str, IdentityRecord] = {}
        for kv in kvs:
            self._put(chunks, nodes, identities, kv.key, kv.value)
        with self._cond:
            self._chunks, self._nodes, self._identities = chunks, nodes, identities
            self._revision, self._synced = revision, True
            self.resyncs += 1
            self._cond.notify_all()

    def _apply(self, resp: Any) -> None:
        with self._cond:
            for ev in resp.events:
                if ev.type == _DELETE:
                    self._delete(ev.kv.key)
                else:
                    self._put(self._chunks, self._nodes, self._identities, ev.kv.key, ev.kv.value)
            if resp.events:  # events arrive in revision order: everything up to the last one is applied
                self._revision = max(self._revision, resp.events[-1].kv.mod_revision)
                self._cond.notify_all()

    def _put(
        self, chunks: dict[bytes, dict[str, Placement]], nodes: dict[str, NodeRecord],
        identities: dict[str, IdentityRecord], key: bytes, value: bytes,
    ) -> None:  # fmt: skip
        ns = self.namespace
        try:
            if key.startswith(ns.chunks):
                chunk, node = ns.parse_replica(key)
                chunks.setdefault(chunk, {})[node] = decode_placement(chunk, node, value)
            elif key.startswith(ns.nodes):
                node_id = ns.parse_node(key)
                nodes[node_id] = decode_node(node_id, value)
            elif key.startswith(ns.identities):
                identities[ns.parse_identity(key)] = decode_identity(value)
        except (MalformedRecord, ValueError) as exc:
            self.malformed += 1
            log.warning("metadata cache: skipping %s: %s", key.decode(errors="replace"), exc)

    def _delete(self, key: bytes) -> None:
        ns = self.namespace
        try:
            if key.startswith(ns.chunks):
                chunk, node = ns.parse_replica(key)
                replicas = self._chunks.get(chunk)
                if replicas is not None:
                    replicas.pop(node, None)
                    if not replicas:
                        del self._chunks[chunk]
            elif key.startswith(ns.nodes):
                self._nodes.pop(ns.parse_node(key), None)
            elif key.startswith(ns.identities):
                self._identities.pop(ns.parse_identity(key), None)
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
                if k not in self._chunks:
                    break
                held += 1
        return held

    def chunks(self) -> list[tuple[bytes, list[Placement]]]:
        """Every chunk with its replicas."""
        with self._cond:
            return [(key, list(replicas.values())) for key, replicas in self._chunks.items()]

    def replicas(self, key: bytes) -> list[Placement]:
        with self._cond:
            return list(self._chunks.get(key, {}).values())

    def size_of(self, key: bytes) -> int:
        """Bytes of chunk ``key`` as its replicas say (0: not held)."""
        with self._cond:
            return max((p.size for p in self._chunks.get(key, {}).values()), default=0)

    def nodes(self) -> list[NodeRecord]:
        with self._cond:
            return sorted(self._nodes.values(), key=lambda n: n.node_id)

    def identities(self) -> dict[str, IdentityRecord]:
        """The cache identities clients registered, by fingerprint."""
        with self._cond:
            return dict(self._identities)

    def chunk_count(self) -> int:
        with self._cond:
            return len(self._chunks)

    def bytes_held(self, node_id: str, tier: Tier) -> int:
        """Bytes of the replicas ``node_id`` holds in ``tier``, from the placements (always current)."""
        with self._cond:
            return sum(p.stored for r in self._chunks.values() if (p := r.get(node_id)) and p.tier is tier)

    def replica_count(self, node_id: str | None = None) -> int:
        with self._cond:
            if node_id is None:
                return sum(len(r) for r in self._chunks.values())
            return sum(1 for r in self._chunks.values() if node_id in r)
