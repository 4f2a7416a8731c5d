"""The simulated side of ``bench/metadata_scale.py``: pool nodes publishing placements and clients watching them,
each kind run as threads of spawned processes that the parent drives over a pipe.

A simulated node goes through the pool's own code paths: ``NodeRegistry`` (its own lease and ``LeaseKeeper``
thread, its own ``EtcdClient``) and ``PlacementStore.publish``.  A watch is either a real ``MetadataCache`` or a bare
watch stream that keeps nothing.  Both note when each etcd revision became visible in them (``CLOCK_MONOTONIC``:
one clock for every process of the host), so the parent can match them with the publishers' acknowledgements.
"""

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from kvpool.core.types import NodeRecord, Placement, SegmentInfo, Tier
from kvpool.errors import MetadataUnavailable
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import Delete, EtcdClient, Put
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore, batches
from kvpool.metadata.records import encode_placement
from kvpool.metadata.registry import NodeRegistration, NodeRegistry

Stamp = tuple[int, float]  #: (etcd revision, CLOCK_MONOTONIC time)


def node_record() -> NodeRecord:
    """A node record of realistic size: 600 bytes of transport address, a DRAM and an NVMe segment.  What each
    simulated node registers, and what ``bench/metadata.py`` encodes and decodes."""
    segments = (SegmentInfo("dram0", Tier.DRAM, 1 << 34, 1 << 30), SegmentInfo("nvme0", Tier.NVME, 1 << 40, 1 << 32))
    return NodeRecord("bench-node", "host-a", 4242, b"x" * 600, segments, time.time(), "host-a:9100")


# -- simulated nodes (in publisher processes) ----------------------------------------------------------------


class _Node:
    """A simulated pool node: registered on its own lease, holding ``count`` placements of random chunk keys."""

    def __init__(self, cfg: MetadataConfig, ns: Namespace, node_id: str, count: int) -> None:
        self.etcd = EtcdClient(cfg)
        self.registration: NodeRegistration = NodeRegistry(self.etcd, ns, cfg.lease_ttl_s).register(
            replace(node_record(), node_id=node_id, started=0.0)
        )
        self.store = PlacementStore(self.etcd, ns)
        self.acked = self.failed = 0  #: placements acknowledged, transactions failed, in the current round
        keys = [hashlib.blake2b(f"{node_id}/{i}".encode(), digest_size=32).digest() for i in range(count)]
        self.items = [Placement(k, node_id, Tier.DRAM, i << 20, 1 << 20, 1 << 20, i) for i, k in enumerate(keys)]
        self.raw = [
            (ns.root + b"raw/" + ns.replica(k, node_id)[len(ns.chunks) :], encode_placement(p))
            for k, p in zip(keys, self.items, strict=True)
        ]

    def publish(self, stamps: list[Stamp]) -> None:
        for batch in batches(self.items, self.store.max_ops):
            self._timed(stamps, len(batch), partial(self.store.publish, batch, self.registration.lease_id))

    def put_raw(self, stamps: list[Stamp]) -> None:
        for batch in batches(self.raw, self.store.max_ops):
            ops = [Put(k, v, self.registration.lease_id) for k, v in batch]
            self._timed(stamps, len(batch), partial(self.etcd.write, ops))

    def _timed(self, stamps: list[Stamp], n: int, write: Callable[[], int]) -> None:
        """One transaction, stamped when acknowledged; one that etcd did not acknowledge in the client's retry
        deadline (an overloaded etcd) is counted, not fatal: the round goes on, as a node's would."""
        try:
            stamps.append((write(), time.monotonic()))
            self.acked += n
        except MetadataUnavailable:
            self.failed += 1

    def delete_raw(self) -> None:
        for batch in batches(self.raw, self.store.max_ops):
            with contextlib.suppress(MetadataUnavailable):  # left on the node's lease: gone when it closes
                self.etcd.write([Delete(k) for k, _ in batch])

    def close(self) -> None:
        self.registration.close(revoke=True)
        self.etcd.close()


def _round(nodes: list[_Node], what: str) -> dict[str, Any]:
    """Every node of this process publishes at once (one thread each); the stamps of every transaction."""
    per_node: list[list[Stamp]] = [[] for _ in nodes]
    threads = [threading.Thread(target=getattr(n, what), args=(s,)) for n, s in zip(nodes, per_node, strict=True)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stamps = [s for ss in per_node for s in ss]
    acked, failed = sum(n.acked for n in nodes), sum(n.failed for n in nodes)
    for n in nodes:
        n.acked = n.failed = 0
    return {
        "start": start,
        "end": max((t for _, t in stamps), default=start),
        "stamps": stamps,
        "acked": acked,
        "failed": failed,
    }


def publisher(conn: Connection, endpoint: str, cluster: str, ttl_s: int) -> None:
    cfg, ns = MetadataConfig(endpoints=(endpoint,), cluster=cluster, lease_ttl_s=ttl_s), Namespace(cluster)
    nodes: list[_Node] = []
    while (msg := conn.recv())[0] == "phase":
        new = [_Node(cfg, ns, node_id, msg[2]) for node_id in msg[1]]
        nodes += new
        conn.send("ready")
        for what in ("publish", "put_raw"):
            conn.recv()  # go
            conn.send(_round(new, what))
        for n in new:
            n.delete_raw()
        conn.send("clean")
    if msg[0] == "leave":  # the first node leaves: its lease revoked, its placements deleted in one revision
        nodes[0].registration.close(revoke=True)
        acked = time.monotonic()
        conn.send((nodes[0].etcd.revision(), acked, len(nodes[0].items)))
        conn.recv()
    for n in nodes[1:] if msg[0] == "leave" else nodes:
        n.close()


# -- watches (in watch processes) ----------------------------------------------------------------------------


class _Watch:
    """When each revision became visible in one watch."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seen: list[Stamp] = []
        self.revision = 0
        self._stop = threading.Event()

    def seen(self, revision: int) -> None:
        with self._cond:
            self.revision = revision
            self._seen.append((revision, time.monotonic()))
            self._cond.notify_all()

    def wait(self, revision: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.revision >= revision, timeout_s)

    def take(self) -> list[Stamp]:
        with self._cond:
            seen, self._seen = self._seen, []
            return seen


class _CacheWatch(_Watch):
    """A real ``MetadataCache``; a thread notes each revision it applies (woken by the cache, no polling)."""

    kind = "cache"

    def __init__(self, etcd: EtcdClient, ns: Namespace) -> None:
        super().__init__()
        self.cache = MetadataCache(etcd, ns).start()
        self.revision = self._last = self.cache.revision
        threading.Thread(target=self._observe, daemon=True).start()

    def _observe(self) -> None:
        while not self._stop.is_set():
            self._last = self.revision
            if self.cache.wait_until(lambda c: c.revision > self._last, 1.0):
                self.seen(self.cache.revision)

    def resyncs(self) -> int:
        return self.cache.resyncs - 1

    def close(self) -> None:
        self._stop.set()
        self.cache.close()


class _BareWatch(_Watch):
    """A watch stream that keeps nothing: etcd's fan-out cost, without a client's decoding and memory."""

    kind = "bare"

    def __init__(self, etcd: EtcdClient, ns: Namespace, start: int) -> None:
        super().__init__()
        self.etcd, self.ns, self.revision, self.breaks = etcd, ns, start - 1, 0
        self.stream = etcd.watch(ns.root, start)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for resp in self.stream:
                    if resp.events:
                        self.seen(resp.events[-1].kv.mod_revision)
                return
            except MetadataUnavailable:  # e.g. one answer over the client's receive limit: resume from now,
                self.breaks += 1  # as a cache re-snapshots (watching from the same revision would break again)
                if not self._stop.is_set():
                    now = self.etcd.revision()
                    self.seen(now)
                    self.stream = self.etcd.watch(self.ns.root, now + 1)

    def resyncs(self) -> int:
        return self.breaks

    def close(self) -> None:
        self._stop.set()
        self.stream.cancel()


def watcher(conn: Connection, endpoint: str, cluster: str, caches: int, bare: int) -> None:
    etcd, ns = EtcdClient(MetadataConfig(endpoints=(endpoint,), cluster=cluster)), Namespace(cluster)
    start = etcd.revision() + 1
    watches: list[_CacheWatch | _BareWatch] = [_CacheWatch(etcd, ns) for _ in range(caches)]
    watches += [_BareWatch(etcd, ns, start) for _ in range(bare)]
    conn.send("ready")
    while (msg := conn.recv())[0] == "collect":
        deadline = time.monotonic() + msg[2]
        caught_up = all(w.wait(msg[1], deadline - time.monotonic()) for w in watches)
        conn.send((caught_up, [(w.kind, w.take(), w.resyncs()) for w in watches]))
    for w in watches:
        w.close()
    etcd.close()
