"""The ``PoolNode`` Ray actor: one per node, contributing its DRAM and NVMe segments to the pool.

A thin shell around :class:`ChunkStore`: it creates the segments and has a :class:`~kvpool.pool.node.publish.Publisher`
join the node registry on a lease and publish every change of the store as placement records in etcd (bound to its
lease, so they vanish with the node).  With a remote tier it also flushes NVMe chunks idle for
``remote.flush_after_s`` to S3 (placements on no lease: they outlive the node); the chunk stays on NVMe, marked as
having a copy, so a full NVMe drops it first.  Its calls are the node protocol (:mod:`kvpool.pool.protocol`).

A threaded actor: the store's books are kept under one lock, held only between I/O steps, so an NVMe read, a
demotion or an S3 upload never holds up another caller's room, fill or pin.  Publishing is ordered by the
publisher's own lock.  Demotions above the high watermark and flushes to S3 run on the node's own threads.
"""

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import ray
from msgspec import Meta

from kvpool.core.config import validated
from kvpool.core.types import NodeRecord, SegmentInfo, Tier
from kvpool.errors import ChunkBusy, MetadataUnavailable, PoolFull, RemoteUnavailable
from kvpool.pool.chunks import SEGMENT_NAMES, Origin, StoredChunk, shared_origin
from kvpool.pool.config import PoolConfig
from kvpool.pool.gds import nvme_io_path
from kvpool.pool.metrics import ClientStats
from kvpool.pool.node.collector import StoreCollector, serve_metrics
from kvpool.pool.node.flush import FLUSH_BYTES, Flusher
from kvpool.pool.node.journal import NvmeJournal, segment_name, take_back
from kvpool.pool.node.moves import read_stored
from kvpool.pool.node.publish import Publisher
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.protocol import Loaded, NodeInfo, Room, Settled, Stored
from kvpool.pool.segment import DramSegment, NvmeSegment, reap_stale_segments
from kvpool.pool.tiers.s3 import RemoteStore
from kvpool.transport.nixl import NixlTransport

log = logging.getLogger(__name__)
IO_THREADS = 4  #: NVMe reads and writes of a batch (promotions, demotions) in flight at once
DEMOTE_BYTES = 64 << 20  #: one demotion step moves at most this much from DRAM to NVMe, then publishes
LATER_S = 0.1  #: what a call leaves to publish later is published within this
_Length = Annotated[int, Meta(ge=1, description="a room length in bytes > 0")]
_NextLength = Annotated[int, Meta(ge=0, description="a room length in bytes >= 0 (0: no next room)")]


class PoolNode:
    """Plain class; :func:`~kvpool.pool.node.launch.start_pool` wraps it as a threaded Ray actor."""

    def __init__(self, config: PoolConfig, node_id: str) -> None:
        self.config = config
        self.node_id = node_id
        tag = f"{node_id[:16]}-{os.getpid()}"  # the pid lets a later node reap what a killed one left
        reap_stale_segments(config.shm_dir, config.nvme_dir or tempfile.gettempdir())
        self.dram = DramSegment.create(config.resolved_dram_bytes(), config.shm_dir, name=tag)
        self._nvme_dir = config.resolved_nvme_dir(tag)
        self._own_nvme_dir = not config.nvme_dir
        nvme_bytes = config.resolved_nvme_bytes(self._nvme_dir)
        self.journal: NvmeJournal | None = None  #: set when the NVMe segment outlives this node (warm restart)
        named: list[StoredChunk] = []  #: what the journal of an earlier node on that segment names
        self.nvme: NvmeSegment | None
        if nvme_bytes > 0 and config.nvme_dir and config.warm_restart:
            name = segment_name(config.metadata.cluster, ray.util.get_node_ip_address())
            self.nvme, self.journal, named = NvmeJournal.open(self._nvme_dir, name, nvme_bytes)
        else:
            self.nvme = NvmeSegment.create(nvme_bytes, self._nvme_dir, name=tag) if nvme_bytes > 0 else None
        self.transport = NixlTransport(f"kvpool-node-{tag}", serve=True, scope=config.metadata.cluster)
        self.transport.register(SEGMENT_NAMES[Tier.DRAM], self.dram.base_address, self.dram.capacity)
        self.store = ChunkStore(
            self.dram,
            self.nvme,
            watermarks=config.watermarks,
            alignment=config.alignment,
            codecs={Tier.NVME: config.nvme_codec},
            demote_inline=False,
            keyring=config.encryption.keyring(),
            quotas=config.quotas,
        )
        self._lock = threading.Lock()  #: the store's books: held only between I/O steps
        self._closing = threading.Event()
        self._flush_lock = threading.Lock()
        self._publish_later = threading.Event()  #: changes a call left for the background thread to publish
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvpool-io")
        self.store.counters.update(flushed=0, flushed_bytes=0, remote_errors=0)
        self.recovery = None
        if self.journal is not None and self.nvme is not None:
            self.recovery = take_back(self.store, self.journal, self.nvme, named, self._io)
        self.remote = RemoteStore(config.remote, config.metadata.cluster) if config.remote.enabled else None
        self.flusher = None if self.remote is None else Flusher(self.remote, config.remote, self.store)
        if self.remote is not None:
            try:
                self.remote.check()
            except RemoteUnavailable as exc:  # the pool runs without it; flushes retry every turn
                self.store.counters["remote_errors"] += 1
                log.warning("remote tier not usable yet: %s", exc)
        self.client_stats = ClientStats()  #: reported by the clients on this node (see PoolClient)
        self._metrics_server, self.metrics_address = None, ""
        if config.metrics_port >= 0:
            collector = StoreCollector(node_id, self.store, self._published, self.client_stats)
            self._metrics_server, self.metrics_address = serve_metrics(
                collector, config.metrics_host, config.metrics_port
            )
        self.publisher = Publisher(config, node_id, self.store, self._lock, self._record, self.journal)
        if self.recovery is not None:
            self.publisher.publish()  # what was taken back is served from now on
        threading.Thread(target=self._timer, name="kvpool-node-timer", daemon=True).start()
        threading.Thread(target=self._background, name="kvpool-node-background", daemon=True).start()
        log.info("pool node %s up: DRAM %d B at %s, NVMe %d B", node_id, self.dram.capacity, self.dram.path, nvme_bytes)

    # -- the node's own threads ------------------------------------------------------------------------

    def _published(self) -> dict[str, int]:
        """What the publisher counts, for the metrics (which are served, and collected once, before it exists)."""
        p: Publisher | None = getattr(self, "publisher", None)
        return {} if p is None else {"etcd_errors": p.errors, "tombstones_unrecorded": p.tombstones.unrecorded}

    def _record(self) -> NodeRecord:
        with self._lock:
            usage = self.store.usage()
        segments = tuple(SegmentInfo(SEGMENT_NAMES[t], t, cap, used) for t, (used, cap) in usage.items())
        return NodeRecord(
            node_id=self.node_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            address=self.transport.descriptor(),
            segments=segments,
            metrics=self.metrics_address,
        )

    def _timer(self) -> None:
        """Thread: reclaim expired reservations every half TTL, and flush idle NVMe chunks to the remote tier every
        quarter of ``flush_after_s`` (at least every 0.1 s, at most every half TTL)."""
        period = self.config.reservation_ttl_s / 2
        if self.remote is not None:
            period = min(period, max(self.config.remote.flush_after_s / 4, 0.1))
        reaped_at = time.monotonic()
        while not self._closing.wait(period):
            try:
                if time.monotonic() - reaped_at >= self.config.reservation_ttl_s / 2:
                    self.reap()
                    reaped_at = time.monotonic()
                if self.remote is not None:
                    self.flush()
            except Exception as exc:  # a failed turn is retried next time; one during shutdown is moot
                if not self._closing.is_set():
                    log.warning("timer turn failed: %s", exc)

    def _background(self) -> None:
        """Thread: every ``LATER_S`` (at once when a commit or promotion left DRAM above its high watermark) move LRU
        chunks to NVMe until the low watermark, ``DEMOTE_BYTES`` at a time, publishing after each step; and publish
        what calls left for later (promotions: the reader has its chunks already)."""
        while not self._closing.is_set():
            self.store.over_high.wait(LATER_S)
            self.store.over_high.clear()
            try:
                self._demote()  # nothing unless DRAM is above its high watermark
                if self._publish_later.is_set():
                    self._publish_later.clear()
                    self.publisher.publish()
            except MetadataUnavailable:
                pass  # the changes are kept for the next publish
            except Exception as exc:  # tried again next turn; one during shutdown is moot
                if not self._closing.is_set():
                    log.warning("background turn failed: %s", exc)

    def _demote(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                moves = self.store.moves.demotions(DEMOTE_BYTES)
            if not moves:
                return
            self.store.moves.run(moves, self._lock, self._io)
            self.publisher.publish()

    # -- the actor's calls -----------------------------------------------------------------------------

    def info(self) -> NodeInfo:
        return NodeInfo(
            self.node_id,
            self.dram.path,
            self.dram.capacity,
            self.nvme.capacity if self.nvme else 0,
            bool(self.nvme and self.nvme.direct),
            self.nvme.path if self.nvme else "",
            self.metrics_address,
            self.recovery.summary() if self.recovery else "",
            os.getpid(),
        )

    def prepare_store(self, length: int) -> Room:
        """DRAM room for a writer's next batch (see :class:`~kvpool.pool.protocol.Room`).  When DRAM has no free extent
        that large, LRU chunks move to NVMe first on this call's thread, their disk writes outside the lock (other
        calls go on meanwhile); only what that could not free is evicted under the lock."""
        validated(_Length, length, "prepare_store: length")
        try:
            with self._lock:
                moves = [] if self.nvme is None else self.store.moves.demotions(need=length)
            if moves:
                self.store.moves.run(moves, self._lock, self._io)
            with self._lock:
                return self.store.open_room(length, self.config.reservation_ttl_s)
        finally:
            self.publisher.publish()  # what moved to make room

    def complete_store(
        self, room_id: int, items: Sequence[object], replicated: bool, next_length: int, origin: Origin = Origin()
    ) -> Stored:
        """Make the chunks written into room ``room_id`` visible as ``origin``'s (see ``ChunkStore.fill_room``) and open
        the writer's next room of ``next_length`` bytes (none if 0, above an eighth of DRAM, or if DRAM has no room for
        it): one call per batch."""
        validated(_NextLength, next_length, "complete_store: next_length")
        origin = shared_origin(validated(Origin, origin, "complete_store: origin"))
        room = None
        try:
            with self._lock:
                self.store.fill_room(room_id, items, replicated=bool(replicated), origin=origin)
                # a writer's idle room holds an eighth of DRAM at most, and is opened only where there is space
                # now: making space (disk writes) is left to the writer's next prepare_store, outside the lock
                if 0 < next_length <= self.dram.capacity // 8 and self.store.allocators[Tier.DRAM].can_allocate(
                    next_length
                ):
                    room = self.store.open_room(next_length, self.config.reservation_ttl_s)
        finally:
            revision = self.publisher.publish()
        return Stored(revision, room)

    def abort_store(self, room_id: int) -> None:
        """Give a room back unfilled (vLLM's ``complete_store(success=False)``)."""
        with self._lock:
            self.store.close_room(room_id)

    def prepare_load(self, keys: Sequence[bytes], promote: bool | None = None, copy_nvme: bool = False) -> Loaded:
        """Pin each held chunk for a reader (None: not held here), promoting NVMe hits to DRAM first if ``promote``
        (default: ``promote_on_hit``) — their NVMe reads run without the lock, several at once; release with
        ``complete_load``.  ``copy_nvme``: also send the stored bytes of those left on NVMe (a peer's reader, whose
        transport reaches DRAM only), read while pinned, without the lock."""
        if self.config.promote_on_hit if promote is None else promote:
            with self._lock:
                moves = self.store.moves.promotions(keys)
            if moves:
                self.store.moves.run(moves, self._lock, self._io)
                self._publish_later.set()  # the reader needs no placement of them: it gets where they are now
        with self._lock:
            chunks = self.store.locate_each(keys)
        on_nvme = [c if c is not None and c.tier is Tier.NVME and copy_nvme else None for c in chunks]
        copies: list[bytes | None] = (
            list(self._io.map(self._read_pinned, on_nvme)) if any(on_nvme) else [None] * len(chunks)
        )
        if any(copies):
            with self._lock:
                self.store.counters["bytes_via_ray"] += sum(len(d) for d in copies if d is not None)
        return Loaded(chunks, copies)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Hits a same-node client read without pinning (see ``PoolClient``): count them, refresh their LRU place."""
        with self._lock:
            for key in keys:
                if key in self.store:  # anything but a held key (a stale hit, a malformed key) is passed over
                    self.store.policy.touch(key)
                    self.store.counters["gets"] += 1

    def report_clients(self, stats: ClientStats) -> None:
        """Add what a client on this node saw since its last report (lookups, gets) to the node's metrics."""
        with self._lock:
            self.client_stats.merge(stats)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Release what ``prepare_load`` pinned."""
        with self._lock:
            for key in keys:
                self.store.release(key)

    def _read_pinned(self, chunk: StoredChunk | None) -> bytes | None:
        if chunk is None:
            return None
        return bytes(read_stored(self.store.segments[chunk.tier], chunk.offset, chunk.stored))

    def remove(self, keys: Sequence[bytes], corrupt: bool = False) -> Settled:
        """Remove held chunks (``corrupt``: even if pinned, counted as corrupt); see :class:`Settled`."""
        busy: list[bytes] = []
        try:
            with self._lock:
                for key in keys:
                    if key in self.store:
                        try:
                            self.store.remove(key, corrupt=corrupt)
                        except ChunkBusy:
                            busy.append(key)
        finally:
            revision = self.publisher.publish()
        return Settled(revision, busy)

    def move(self, keys: Sequence[bytes], tier: Tier) -> Settled:
        """Move held chunks to ``tier`` (their I/O without the lock); see :class:`Settled`.  ``PoolFull`` once the
        rest is done if ``tier`` had no room for some."""
        with self._lock:
            moves, busy, full = self.store.moves.moves_to(keys, tier)
        try:
            self.store.moves.run(moves, self._lock, self._io)
        finally:
            revision = self.publisher.publish()
        failed = [m.failed for m in moves if m.failed]
        if full or failed:
            raise PoolFull(full or failed[0])
        return Settled(revision, busy)

    def reap(self) -> int:
        """Reclaim rooms idle past their TTL (``reservation_ttl_s``; see ``ChunkStore.reap``), and retry a publish that
        etcd refused earlier."""
        with self._lock:
            reaped = self.store.reap()
        with contextlib.suppress(MetadataUnavailable):
            self.publisher.publish()
        return reaped

    def flush(self, max_bytes: int = FLUSH_BYTES) -> int:
        """Upload NVMe chunks idle for ``remote.flush_after_s`` to the remote tier (a :class:`Flusher` turn, its reads and
        uploads without the lock) and publish their S3 placements on no lease.  Returns how many were flushed.  A
        failed upload leaves the chunks on NVMe, unflushed: a later turn tries again; nothing is lost."""
        with self._flush_lock:  # the timer's turn, or a caller's (tests, benchmarks): one at a time
            if self.flusher is None or not self.flusher.due():
                return 0
            placements = self.flusher.turn(self._lock, max_bytes)
            with contextlib.suppress(MetadataUnavailable):
                self.publisher.publish()  # chunks found corrupt
            try:
                self.publisher.placements.publish(placements, 0)  # no lease: the copy outlives this node
            except MetadataUnavailable as exc:
                self.publisher.errors += 1
                log.warning("flushed %d chunks, could not publish them (retried next turn): %s", len(placements), exc)
                return 0
            with self._lock:
                self.store.mark_in_remote(p.key for p in placements)
                self.store.counters["flushed"] += len(placements)
                self.store.counters["flushed_bytes"] += sum(p.stored for p in placements)
            return len(placements)

    def audit(self) -> list[str]:
        """What disagrees in this node (empty: nothing): its store's books (``ChunkStore.audit``), and its chunks
        against the placements etcd shows for it, after publishing what is pending."""
        with self._lock:
            problems = self.store.audit()
        try:
            return problems + self.publisher.mismatches()
        except MetadataUnavailable as exc:
            return [*problems, f"etcd not reachable, placements not compared: {exc}"]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            usage = self.store.tier_figures()
            counters = dict(self.store.counters)
        return {
            "node_id": self.node_id,
            "tiers": usage,
            "watermarks": {"high": self.config.watermarks.high, "low": self.config.watermarks.low},
            "nvme_direct": bool(self.nvme and self.nvme.direct),
            "registrations": self.transport.registrations,
            "nvme_io": nvme_io_path().name,  #: NVMe <-> GPU: gds (cuFile), kvikio-compat or posix (see pool/gds.py)
            "nvme_io_reason": nvme_io_path().reason,
            "restart": self.recovery.figures() if self.recovery else {},
            "codecs": {Tier.DRAM.value: "raw", Tier.NVME.value: self.config.nvme_codec}
            | ({Tier.REMOTE.value: self.config.remote.codec} if self.remote else {}),
            **counters,
        }

    def shutdown(self) -> None:
        """Leave the pool now: revoke the lease (its placements go with it) and free the segments."""
        self._closing.set()
        self._io.shutdown(wait=True)
        self.publisher.close()
        self.transport.close()
        if self.remote is not None:
            self.remote.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.dram.close()
        if self.nvme is not None:
            self.nvme.close()  # a warm-restart segment is kept (not its owner), its journal synced below
        if self.journal is not None:
            self.journal.close()
        if self._own_nvme_dir:
            shutil.rmtree(self._nvme_dir, ignore_errors=True)
