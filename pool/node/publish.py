"""What a pool node tells etcd: its record on a lease, and one placement per chunk it holds, following its store.

Every change the store records is published as placements bound to the node's lease (so they vanish with the node),
one publish at a time and in the order the store changed (told first to the node's NVMe journal, if it keeps one:
:mod:`kvpool.pool.node.journal`); a publish etcd refused is kept and sent again with the next one.  A dropped chunk leaves a tombstone saying why, written with the delete, and the node records the
departure of every other node it sees leave (:mod:`kvpool.metadata.tombstones`).  The record's usage figures are
refreshed by a thread, at most every ``RECORD_REFRESH_S``.  A lost and replaced lease republishes every placement.  The placements of the remote tier go out on no lease (they outlive the
node) through :attr:`Publisher.placements`.
"""

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

from kvpool.core.types import DropCause, NodeRecord, Placement
from kvpool.errors import MetadataUnavailable
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore
from kvpool.metadata.registry import NodeRegistry
from kvpool.metadata.tombstones import TombstoneWriter
from kvpool.pool.chunks import Change, ChangeKind, StoredChunk, short
from kvpool.pool.config import PoolConfig
from kvpool.pool.node.journal import NvmeJournal
from kvpool.pool.node.store import ChunkStore

log = logging.getLogger(__name__)
RECORD_REFRESH_S = 1.0  #: the node record's usage figures lag by at most this


class Publisher:
    """Publishes ``store`` (whose books ``lock`` guards) as node ``node_id``; ``record()`` is the node's record now."""

    def __init__(
        self,
        config: PoolConfig,
        node_id: str,
        store: ChunkStore,
        lock: AbstractContextManager[object],
        record: Callable[[], NodeRecord],
        journal: NvmeJournal | None = None,
    ) -> None:
        self.node_id, self.store, self._lock, self._record = node_id, store, lock, record
        self.journal = journal  #: told every change first, when the NVMe segment outlives the node
        self.errors = 0  #: etcd requests that failed after their retries
        self.lock = threading.RLock()  #: one publish at a time, in the order the store changed
        self._revision = 0  #: the etcd revision of the last publish
        self._unpublished: list[Change] = []  #: changes a failed publish still owes etcd, oldest first
        self._record_dirty, self._closing = threading.Event(), threading.Event()
        self.etcd = EtcdClient(config.metadata)
        namespace = Namespace(config.metadata.cluster)
        self.placements = PlacementStore(self.etcd, namespace)
        self.tombstones = TombstoneWriter(self.etcd, namespace, node_id)
        since = self.etcd.revision() + 1
        self.registration = NodeRegistry(self.etcd, namespace, config.metadata.lease_ttl_s).register(
            record(), on_new_lease=self._republish
        )
        threading.Thread(target=self._refresh_record, name="kvpool-node-record", daemon=True).start()
        threading.Thread(
            target=self.tombstones.follow_departures, args=(since, self._closing), name="kvpool-departures", daemon=True
        ).start()

    def placement(self, chunk: StoredChunk) -> Placement:
        return Placement(
            key=chunk.key,
            node=self.node_id,
            tier=chunk.tier,
            offset=chunk.offset,
            stored=chunk.stored,
            size=chunk.size,
            checksum=chunk.checksum,
            codec=chunk.codec,
            identity=chunk.origin.identity,
        )

    def publish(self) -> int:
        """Publish what the store changed (and what an earlier publish failed to); returns the etcd revision a
        reader must reach to see it.  If etcd is unreachable the changes are kept for the next publish — every
        call that changes the store publishes, and so do the node's threads — and the caller gets
        ``MetadataUnavailable``, so nothing is acknowledged that etcd does not show."""
        with self.lock:
            with self._lock:
                fresh = self.store.take_changes()
            if self.journal is not None:
                self.journal.record(fresh)
            changes, self._unpublished = [*self._unpublished, *fresh], []
            final = {change.chunk.key: change for change in changes}
            puts = [self.placement(c.chunk) for c in final.values() if c.kind is not ChangeKind.DROPPED]
            drops = [
                (self.placement(c.chunk), c.cause or DropCause.REMOVED)
                for c in final.values()
                if c.kind is ChangeKind.DROPPED
            ]
            try:
                stones = self.tombstones.ops(drops, self.store.policy.name)
                revision = max(
                    self.placements.publish(puts, self.registration.lease_id),
                    self.placements.delete([p for p, _ in drops], stones),
                )
            except MetadataUnavailable:
                self.errors += 1
                self._unpublished = changes  # publishing is idempotent: all of them again next time
                raise
            if final:
                self._record_dirty.set()
            self._revision = max(self._revision, revision)  # a publish of nothing: what the last one showed
            return self._revision

    def mismatches(self) -> list[str]:
        """Where the store's chunks and the placements etcd shows for this node disagree (empty: nowhere), after
        publishing what is pending; ``MetadataUnavailable`` if etcd cannot be asked."""
        with self.lock:  # no publish in flight while the two are compared
            self.publish()
            with self._lock:
                held = {c.key: c for c in self.store.chunks()}
            published = {p.key: p for p in self.placements.held_by(self.node_id)}
        problems = [f"chunk {short(key)} is held but has no placement" for key in held.keys() - published.keys()]
        problems += [
            f"placement of {short(k)} names a chunk this node does not hold" for k in published.keys() - held.keys()
        ]
        for key in held.keys() & published.keys():
            c, p = held[key], published[key]
            if (c.tier, c.offset, c.stored, c.checksum, c.codec, c.origin.identity) != (
                p.tier,
                p.offset,
                p.stored,
                p.checksum,
                p.codec,
                p.identity,
            ):
                problems.append(f"chunk {short(key)}: held as {c}, published as {p}")
        return problems

    def _refresh_record(self) -> None:
        """Thread: publish the node record's usage figures at most every RECORD_REFRESH_S, when changed."""
        while not self._closing.wait(RECORD_REFRESH_S):
            if self._record_dirty.is_set():
                self._record_dirty.clear()
                try:
                    self.registration.update(self._record())
                except MetadataUnavailable as exc:
                    self.errors += 1
                    log.warning("node record not refreshed: %s", exc)
                    self._record_dirty.set()

    def _republish(self, lease_id: int) -> None:
        """The lease was lost and replaced: every placement on the old one is gone; publish them again."""
        with self._lock:
            chunks = self.store.chunks()
        self.placements.publish([self.placement(c) for c in chunks], lease_id)
        self.registration.update(self._record())

    def close(self) -> None:
        """Revoke the lease (the placements on it go with it) and close the etcd client."""
        self._closing.set()
        self.registration.close(revoke=True)
        self.etcd.close()
