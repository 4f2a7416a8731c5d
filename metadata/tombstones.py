"""Tombstones: why a chunk is gone, kept in etcd a while after the chunk.

A node writes ``gone/<key>/<node>`` (a :class:`~kvpool.core.types.Tombstone`: evicted, removed or corrupt, the
tier, the time, the policy) in the same transaction that deletes the placement; and when a node's record leaves
etcd (its lease ran out, or it shut down) the surviving nodes write ``departed/<node>`` (a
:class:`~kvpool.core.types.Departure` with the revision of that delete: its placements went at the same
revision, so etcd's history at the revision before says which chunks it held).

Both go on a *tombstone lease* of :data:`TTL_S`, a new one every half of it, so a tombstone lives between half
the TTL and the TTL; a node writes at most :data:`PER_WINDOW` tombstones per lease (drops past that are counted,
not recorded), which bounds what tombstones cost etcd and every watch cache.
"""

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.core.types import Departure, DropCause, Placement, Tombstone
from kvpool.errors import MetadataUnavailable
from kvpool.metadata.client import EtcdClient, Put, Version, WatchStream
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import encode_departure, encode_tombstone

log = logging.getLogger(__name__)

TTL_S = 3600  #: a tombstone outlives its chunk by between half this and this
PER_WINDOW = 20_000  #: tombstones one node writes per lease (half of TTL_S); drops past it go unrecorded
_DELETE = 1  # mvccpb.Event.EventType


class TombstoneWriter:
    """Node ``node_id``'s tombstones and the departures it sees, on a rolling lease."""

    def __init__(
        self,
        etcd: EtcdClient,
        namespace: Namespace,
        node_id: str,
        *,
        ttl_s: int = TTL_S,
        per_window: int = PER_WINDOW,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.etcd, self.namespace, self.node_id = etcd, namespace, node_id
        self.ttl_s, self.per_window, self.clock = ttl_s, per_window, clock
        self.unrecorded = 0  #: drops past a window's budget
        self._lease, self._since, self._written = 0, 0.0, 0
        self._lock = threading.Lock()

    def _current(self) -> int:
        """The lease of this window (granted when the last one is half its TTL old)."""
        now = self.clock()
        if not self._lease or now - self._since >= self.ttl_s / 2:
            self._lease, self._since, self._written = self.etcd.grant_lease(self.ttl_s), now, 0
        return self._lease

    def ops(self, drops: Sequence[tuple[Placement, DropCause]], policy: str) -> list[Any]:
        """The puts recording ``drops`` (placements this node just deleted, with why), within the window's budget."""
        if not drops:
            return []
        with self._lock:
            lease = self._current()
            room = max(0, self.per_window - self._written)
            self.unrecorded += max(0, len(drops) - room)
            kept = drops[:room]
            self._written += len(kept)
        now = self.clock()
        return [
            Put(
                self.namespace.tombstone(p.key, self.node_id),
                encode_tombstone(
                    Tombstone(p.key, self.node_id, cause, p.tier, now, policy if cause is DropCause.EVICTED else "")
                ),
                lease,
            )
            for p, cause in kept
        ]

    def departed(self, node: str, revision: int) -> None:
        """Record that ``node``'s record was deleted at ``revision`` (once, whichever survivor is first)."""
        key = self.namespace.departure(node)
        with self._lock:
            lease = self._current()
        value = encode_departure(Departure(node, revision, self.clock()))
        self.etcd.txn([Version(key) == 0], [Put(key, value, lease)])

    def follow_departures(self, from_revision: int, stop: threading.Event) -> None:
        """Thread body: watch the node records from ``from_revision`` and record every other node's departure."""
        ns = self.namespace
        current: list[WatchStream | None] = [None]

        def cancel_on_stop() -> None:
            stop.wait()
            if current[0] is not None:
                current[0].cancel()

        threading.Thread(target=cancel_on_stop, name="kvpool-departures-stop", daemon=True).start()
        while not stop.is_set():
            try:
                watch = current[0] = self.etcd.watch(ns.nodes, from_revision)
                if stop.is_set():
                    watch.cancel()
                for resp in watch:
                    for ev in resp.events:
                        from_revision = max(from_revision, int(ev.kv.mod_revision) + 1)
                        if ev.type != _DELETE:
                            continue
                        node = ns.parse_node(ev.kv.key)
                        if node != self.node_id:
                            self.departed(node, int(ev.kv.mod_revision))
                return
            except MetadataUnavailable as exc:
                if stop.is_set():
                    return
                log.warning("departures not followed (%s); again in 1 s", exc)
                stop.wait(1.0)
