"""The node registry: one record per live node, bound to that node's lease."""

import threading
from collections.abc import Callable
from dataclasses import replace

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.core.types import NodeRecord
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.lease import LeaseKeeper
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import encode_node


class NodeRegistration:
    """A node's presence in the registry: its record, kept on a lease that a thread keeps alive.

    ``on_new_lease`` runs after a lost lease was replaced and the record re-published; the pool uses
    it to publish its placements again (they were bound to the old lease and are gone).
    """

    def __init__(
        self,
        etcd: EtcdClient,
        namespace: Namespace,
        record: NodeRecord,
        ttl_s: int,
        *,
        clock: Clock = SYSTEM_CLOCK,
        on_new_lease: Callable[[int], None] | None = None,
        keep_alive: bool = True,
    ) -> None:
        self.etcd = etcd
        self.namespace = namespace
        self.clock = clock
        self._lock = threading.Lock()
        self._record = replace(record, started=record.started or clock.time())
        self._first = True
        self._user_callback = on_new_lease
        self.keeper = LeaseKeeper(etcd, ttl_s, self._publish_on, clock=clock, name=f"node {record.node_id}")
        if keep_alive:
            self.keeper.start()

    @property
    def node_id(self) -> str:
        return self._record.node_id

    @property
    def lease_id(self) -> int:
        return self.keeper.lease_id

    @property
    def record(self) -> NodeRecord:
        with self._lock:
            return self._record

    def _publish_on(self, lease_id: int) -> None:
        with self._lock:
            self.etcd.put(self.namespace.node(self.node_id), encode_node(self._record), lease=lease_id)
        if not self._first and self._user_callback is not None:
            self._user_callback(lease_id)
        self._first = False

    def update(self, record: NodeRecord) -> None:
        """Publish a new version of the record (e.g. segment usage) on the current lease."""
        assert record.node_id == self.node_id, f"record of node {record.node_id!r} on {self.node_id!r}'s registration"
        with self._lock:
            self._record = replace(record, started=self._record.started)
            self.etcd.put(self.namespace.node(self.node_id), encode_node(self._record), lease=self.lease_id)

    def close(self, revoke: bool = True) -> None:
        """Leave the pool: with ``revoke``, the record and every placement on the lease go at once."""
        self.keeper.stop(revoke=revoke)


class NodeRegistry:
    """Joins the registry of one cluster (readers use :class:`~kvpool.metadata.cache.MetadataCache`)."""

    def __init__(self, etcd: EtcdClient, namespace: Namespace, ttl_s: int, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.etcd = etcd
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.clock = clock

    def register(
        self,
        record: NodeRecord,
        *,
        on_new_lease: Callable[[int], None] | None = None,
        keep_alive: bool = True,
    ) -> NodeRegistration:
        return NodeRegistration(
            self.etcd,
            self.namespace,
            record,
            self.ttl_s,
            clock=self.clock,
            on_new_lease=on_new_lease,
            keep_alive=keep_alive,
        )
