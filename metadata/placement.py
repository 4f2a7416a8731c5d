"""Placement records in etcd: publish (batched), delete, read back what a node holds.

One etcd key per replica, ``<chunks>/<key hex>/<node>``, bound to the holder's lease.  Batches are split
into transactions of at most ``txn_max_ops`` operations (etcd's default limit is 128).
"""

import logging
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from kvpool.core.types import Placement
from kvpool.errors import MalformedRecord
from kvpool.metadata.client import Delete, EtcdClient, Put
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import decode_placement, encode_placement

log = logging.getLogger(__name__)
T = TypeVar("T")


def batches(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class PlacementStore:
    def __init__(self, etcd: EtcdClient, namespace: Namespace) -> None:
        self.etcd = etcd
        self.namespace = namespace
        self.max_ops = etcd.config.txn_max_ops

    def _etcd_key(self, p: Placement) -> bytes:
        return self.namespace.replica(p.key, p.node)

    def publish(self, placements: Sequence[Placement], lease_id: int) -> int:
        """Write (or overwrite) placements bound to ``lease_id`` (0: none), one transaction per ``txn_max_ops``;
        the etcd revision that shows them all (0: nothing to write)."""
        revision = 0
        for batch in batches(placements, self.max_ops):
            ops = [Put(self._etcd_key(p), encode_placement(p), lease_id) for p in batch]
            revision = max(revision, self.etcd.write(ops))
        return revision

    def delete(self, placements: Sequence[Placement], also: Sequence[Any] = ()) -> int:
        """Delete placements, and write ``also`` (their tombstones) in the same transactions; the etcd revision
        that shows them gone (0: nothing to delete)."""
        revision = 0
        for batch in batches([*(Delete(self._etcd_key(p)) for p in placements), *also], self.max_ops):
            revision = max(revision, self.etcd.write(batch))
        return revision

    def held_by(self, node: str) -> list[Placement]:
        """Every replica ``node`` holds, straight from etcd (one range read of every placement)."""
        out = []
        for kv in self.etcd.get_prefix(self.namespace.chunks):
            p = self._decode(kv.key, kv.value)
            if p is not None and p.node == node:
                out.append(p)
        return out

    def _decode(self, etcd_key: bytes, raw: bytes) -> Placement | None:
        try:
            key, node = self.namespace.parse_replica(etcd_key)
            return decode_placement(key, node, raw)
        except (MalformedRecord, ValueError) as exc:
            log.warning("skipping placement %s: %s", etcd_key.decode(errors="replace"), exc)
            return None
