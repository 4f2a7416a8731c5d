"""Placement records in etcd: publish (batched, create-if-absent), delete, read, longest prefix.

One etcd key per replica, ``<chunks>/<key hex>/<node>``, bound to the holder's lease.  Batches are split
into transactions of at most ``txn_max_ops`` operations (etcd's default limit is 128).
"""

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvpool.errors import MalformedRecord
from kvpool.metadata.client import Delete, EtcdClient, Get, Put, prefix_end
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import Placement

log = logging.getLogger(__name__)
T = TypeVar("T")


def batches(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


@dataclass
class PublishResult:
    created: list[Placement] = field(default_factory=list)
    existing: list[Placement] = field(default_factory=list)  #: another value already held the key


class PlacementStore:
    def __init__(self, etcd: EtcdClient, namespace: Namespace) -> None:
        self.etcd = etcd
        self.namespace = namespace
        self.max_ops = etcd.config.txn_max_ops

    def _etcd_key(self, p: Placement) -> bytes:
        return self.namespace.replica(p.key, p.node)

    def publish(self, placements: Sequence[Placement], lease_id: int, *, if_absent: bool = True) -> PublishResult:
        """Write placements bound to ``lease_id``, one transaction per ``txn_max_ops`` of them.

        With ``if_absent`` (the default) a replica key that already exists is left alone and reported in
        ``existing``; the others in the same batch are still created.  A retried transaction that had
        in fact committed finds its own values and counts them as created.
        """
        result = PublishResult()
        for batch in batches(placements, self.max_ops):
            if not if_absent:
                self.etcd.txn([], [Put(self._etcd_key(p), p.encode(), lease_id) for p in batch])
                result.created.extend(batch)
                continue
            pending = list(batch)
            while pending:
                keys = [self._etcd_key(p) for p in pending]
                values = [p.encode() for p in pending]
                ok, responses = self.etcd.txn(
                    [self.etcd.absent(k) for k in keys],
                    [Put(k, v, lease_id) for k, v in zip(keys, values, strict=True)],
                    [Get(k) for k in keys],
                )
                if ok:
                    result.created.extend(pending)
                    break
                still = []
                for p, value, found in zip(pending, values, responses, strict=True):
                    if not found:
                        still.append(p)  # absent: try again without the keys that blocked the batch
                    elif found[0].value == value and found[0].lease == lease_id:
                        result.created.append(p)  # our own earlier, retried write
                    else:
                        result.existing.append(p)
                pending = still
        return result

    def delete(self, placements: Sequence[Placement]) -> None:
        for batch in batches(placements, self.max_ops):
            self.etcd.txn([], [Delete(self._etcd_key(p)) for p in batch])

    def replicas(self, key: bytes) -> list[Placement]:
        """Every replica of one chunk, straight from etcd (malformed ones logged and skipped)."""
        return [p for kv in self.etcd.get_prefix(self.namespace.chunk(key)) if (p := self._decode(kv.key, kv.value))]

    def held_by(self, node: str) -> list[Placement]:
        """Every replica ``node`` holds, straight from etcd (one range read of every placement)."""
        out = []
        for kv in self.etcd.get_prefix(self.namespace.chunks):
            p = self._decode(kv.key, kv.value)
            if p is not None and p.node == node:
                out.append(p)
        return out

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks of ``keys`` have at least one replica, asking etcd (one round trip per
        ``txn_max_ops`` keys).  :class:`MetadataCache` answers the same question without etcd."""
        held = 0
        for batch in batches(keys, self.max_ops):
            prefixes = [self.namespace.chunk(k) for k in batch]
            _, responses = self.etcd.txn([], [Get(p, prefix_end(p)) for p in prefixes])
            for kvs in responses:
                if not any(self._decode(kv.key, kv.value) for kv in kvs):
                    return held
                held += 1
        return held

    def _decode(self, etcd_key: bytes, raw: bytes) -> Placement | None:
        try:
            key, node = self.namespace.parse_replica(etcd_key)
            return Placement.decode(key, node, raw)
        except (MalformedRecord, ValueError) as exc:
            log.warning("skipping placement %s: %s", etcd_key.decode(errors="replace"), exc)
            return None
