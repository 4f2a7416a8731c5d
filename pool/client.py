"""``PoolClient``: put and get KV chunks anywhere in the pool.

Works from a Ray driver, task or actor (``ray.init`` done).  Lookups (``exists``, ``lookup_prefix``, the
replicas of a chunk) are answered by a local watch-synced copy of etcd, without a round trip.  Data:

- **same node**: the client maps its node's DRAM segment; a put reserves room (one actor call), writes
  straight into the shared memory and commits (one call); a get copies the chunk out of the mapping at
  the offset its placement gives and verifies the checksum — no call at all; only if that fails (the
  chunk moved or is being evicted) does it pin the chunk (one call), copy it and unpin.
- **another node**: one-sided NIXL/UCX transfers (:mod:`kvpool.transport.nixl`) between a staging
  buffer registered by this client and the holder's registered DRAM segment.  A put reserves room on
  the holder (one actor call), WRITEs the bytes and commits (one call); a get pins the chunk (one call,
  promoting it from NVMe), READs it and unpins.  No KV byte passes through Ray or etcd, except a chunk
  left on a remote NVMe tier (``promote_on_hit`` off, or DRAM full), which comes back as a call result.
- **the remote (S3) tier**: a chunk whose only copies are there is fetched by the client itself (boto3,
  several GETs at once), verified, decoded and, with ``remote.promote_on_hit``, put back into the pool.

A chunk stored with a codec (NVMe ``nvme_codec``, remote ``remote.codec``) is verified on its stored bytes
and then decoded into the caller's buffer; what a reader gets has the placement's ``size``.

Every read is checked against the checksum stored in its placement: a mismatch drops that replica
(everywhere) and tries the next; if none is intact the caller gets :class:`CorruptChunk`, a kind of
:class:`ChunkNotFound` — a miss, never wrong bytes.
"""

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import ray
import torch

from kvpool.errors import (
    ChunkBusy,
    ChunkNotFound,
    ConfigError,
    CorruptChunk,
    KvPoolError,
    MetadataUnavailable,
    PoolFull,
    RemoteUnavailable,
    TransferError,
    UndecodableChunk,
)
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore
from kvpool.metadata.records import Placement, Tier
from kvpool.pool.buffers import byte_view
from kvpool.pool.config import PoolConfig
from kvpool.pool.keys import check_key
from kvpool.pool.metrics import SOURCES, ClientStats
from kvpool.pool.node import NodeInfo, Settled, actor_name
from kvpool.pool.segment import DramSegment, NvmeSegment
from kvpool.pool.store import SEGMENT_NAMES, Reservation, StoredChunk, checksum, short
from kvpool.pool.tiers.codecs import TensorFormat, decode
from kvpool.pool.tiers.gds import DeviceIO
from kvpool.pool.tiers.s3 import RemoteStore, collect_garbage
from kvpool.transport.base import Op
from kvpool.transport.nixl import NixlTransport

log = logging.getLogger(__name__)
STAGING_BYTES = 64 << 20  #: cross-node transfers through the staging buffer move at most this much per round
REMOTE_THREADS = 8  #: concurrent GETs from the remote tier in one batch
Summary = tuple[int, TensorFormat | None]  #: what a commit says of a chunk: its checksum and its tensor format


def _get(ref: Any, timeout: float | None = 60) -> Any:
    """``ray.get`` that re-raises a pool node's own kvpool error as itself, and a dead or unreachable
    node as ``ChunkNotFound`` (for a read: a miss; the caller moves on to the next replica)."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, KvPoolError):
            raise exc.cause from None
        raise
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
        raise ChunkNotFound(f"pool node unreachable: {type(exc).__name__}") from exc


def _fill(dest: memoryview, data: Any, codec: str, expected: int) -> bool:
    """Put a chunk's stored bytes (encoded with ``codec``) into ``dest`` if they match their checksum and
    decode to exactly ``dest``'s size; whether they did."""
    if codec == "raw":
        dest[:] = data
        return checksum(dest) == expected
    if checksum(data) != expected:
        return False
    try:
        flat = byte_view(decode(data))
    except UndecodableChunk:
        return False
    if flat.nbytes != dest.nbytes:
        return False
    dest[:] = flat
    return True


def _device_bytes(t: Any, field: str) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor on any device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{field} must be a torch tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{field} is a non-contiguous tensor; call .contiguous() first")
    return t.detach().reshape(-1).view(torch.uint8)


def _host_like(t: torch.Tensor) -> torch.Tensor:
    """A host buffer for ``t``'s bytes: page-locked when CUDA is there, so the copy to the device is a DMA."""
    return torch.empty(t.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _buffer_region(buffer: Any) -> tuple[str, int, int]:
    """``(region name, address, nbytes)`` of a caller's writable buffer."""
    view = byte_view(buffer, writable=True, field="buffer")
    address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    return f"user-{address:x}-{view.nbytes}", address, view.nbytes


def _at(fn: Callable[[int], None], index: list[int], j: int) -> None:
    fn(index[j])


class PoolClient:
    def __init__(self, config: PoolConfig) -> None:
        if not ray.is_initialized():
            raise ConfigError("PoolClient needs Ray: call ray.init(address=...) first")
        self.config = config
        self.node_id = ray.get_runtime_context().get_node_id()
        self.etcd = EtcdClient(config.metadata)
        self.cache = MetadataCache(self.etcd, Namespace(config.metadata.cluster)).start()
        self.placements = PlacementStore(self.etcd, Namespace(config.metadata.cluster))
        self._remote: RemoteStore | None = None  #: made on first use of the remote tier
        self._device_io: DeviceIO | None = None  #: this node's NVMe segment, for get_into_device
        self._info: NodeInfo | None = None
        self.device_reads = {"direct": 0, "direct_bytes": 0, "via_host": 0, "via_host_bytes": 0}
        self._actors: dict[str, Any] = {}
        self._segment: DramSegment | None = None
        self._local: Any = None
        self._transport: NixlTransport | None = None  #: started on the first cross-node transfer
        self._stage: np.ndarray | None = None
        self._peers: dict[str, str] = {}
        self._registered: dict[str, tuple[int, int]] = {}  #: caller buffers registered with the transport
        self.transfer_timeout_s = 30.0
        self._seen, self._reported_at = ClientStats(), time.monotonic()  #: for the node's metrics
        try:
            self._local = self._actor(self.node_id)
            info: NodeInfo = _get(self._local.info.remote())
            self._segment = DramSegment.attach(info.dram_path, info.dram_capacity)
            self._info = info
        except ChunkNotFound:
            log.info("no pool node on this Ray node (%s): every transfer goes remote", self.node_id[:12])

    def close(self) -> None:
        self._report(force=True)
        if self._transport is not None:
            self._transport.close()
        if self._remote is not None:
            self._remote.close()
        if self._device_io is not None:
            self._device_io.close()
            self._device_io.segment.close()
        self.cache.close()
        self.etcd.close()
        if self._segment is not None:
            self._segment.close()

    def __enter__(self) -> "PoolClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _actor(self, node_id: str) -> Any:
        if node_id not in self._actors:
            try:
                self._actors[node_id] = ray.get_actor(actor_name(node_id), namespace=self.config.namespace)
            except ValueError:
                raise ChunkNotFound(f"no pool node actor for node {node_id[:12]} (it died or was stopped)") from None
        return self._actors[node_id]

    # -- put -------------------------------------------------------------------------------------------

    def put(self, key: bytes, data: Any, replicas: int = 1) -> None:
        self.put_batch([(key, data)], replicas=replicas)

    def put_batch(self, items: Sequence[tuple[bytes, Any]], replicas: int = 1, nodes: Sequence[str] = ()) -> None:
        """Store each ``(key, data)`` on ``replicas`` distinct nodes: this node first when it has a pool
        node, then those with the most free space; or exactly on ``nodes`` when given.  Keys name
        content: a key already held by a target is not written again.  A chunk given as a float tensor
        carries its format, so tiers with a codec can encode it; bytes are stored raw everywhere."""
        views = [(check_key(k), byte_view(d)) for k, d in items]
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        live = {n.node_id for n in self.cache.nodes()}
        if unknown := [n for n in nodes if n not in live]:
            raise ChunkNotFound(f"no live pool node {', '.join(u[:12] for u in unknown)}: pick from kvpool status")
        targets = list(dict.fromkeys(nodes)) or self._targets(replicas)
        sums = [(checksum(v), TensorFormat.of(d)) for (_, v), (_, d) in zip(views, items, strict=True)]
        revision, replicated = 0, len(targets) > 1
        for node_id in targets:
            if node_id == self.node_id and self._segment is not None:
                revision = max(revision, self._local_put(views, sums, replicated))
            else:
                revision = max(revision, self._remote_put(node_id, views, sums, replicated))
        self.cache.wait_until(lambda c: c.revision >= revision, timeout_s=self.config.metadata.retry_deadline_s)

    def _targets(self, replicas: int) -> list[str]:
        nodes = self.cache.nodes()
        if len(nodes) < replicas:
            raise PoolFull(f"replicas={replicas} needs {replicas} pool nodes; {len(nodes)} are alive")
        free = {n.node_id: sum(s.capacity - s.used for s in n.segments) for n in nodes}
        ordered = sorted(free, key=lambda nid: (nid != self.node_id or self._segment is None, -free[nid]))
        return ordered[:replicas]

    def _local_put(self, views: list[tuple[bytes, memoryview]], sums: list[Summary], replicated: bool) -> int:
        """Reserve, write into the shared segment, commit; in rounds of at most a quarter of the segment,
        since space reserved but not yet committed cannot be evicted to make room."""
        assert self._segment is not None
        revision, start, budget = 0, 0, max(1, self._segment.capacity // 4)
        while start < len(views):
            end, total = start, 0
            while end < len(views) and (end == start or total + views[end][1].nbytes <= budget):
                total += views[end][1].nbytes
                end += 1
            revision = max(revision, self._local_put_round(views[start:end], sums[start:end], replicated))
            start = end
        return revision

    def _local_put_round(self, views: list[tuple[bytes, memoryview]], sums: list[Summary], replicated: bool) -> int:
        assert self._segment is not None
        reservations: list[Reservation] = _get(self._local.reserve_batch.remote([(k, v.nbytes) for k, v in views]))
        fresh = [(r, v, s) for r, (_, v), s in zip(reservations, views, sums, strict=True) if not r.already_stored]
        try:
            for r, view, _ in fresh:
                self._segment.write(r.offset, view)
        except BaseException:
            _get(self._local.abort_batch.remote([r.key for r, _, _ in fresh]))
            raise
        return int(_get(self._local.commit_batch.remote([(r.key, *s) for r, _, s in fresh], replicated)))

    def _remote_put(
        self, node_id: str, views: list[tuple[bytes, memoryview]], sums: list[Summary], replicated: bool
    ) -> int:
        """Reserve on the holder, WRITE from the staging buffer, commit; in rounds that fit the staging
        buffer and a quarter of the holder's DRAM (reserved space cannot be evicted)."""
        actor, peer = self._actor(node_id), self._peer(node_id)
        record = next((n for n in self.cache.nodes() if n.node_id == node_id), None)
        if record is None:  # it left the pool since the put chose it
            raise ChunkNotFound(f"pool node {node_id[:12]} left the pool during the put; put again")
        budget = max(record.capacity(Tier.DRAM) // 4, 1)
        revision, start = 0, 0
        while start < len(views):
            end, total = start, 0
            while end < len(views) and (end == start or total + views[end][1].nbytes <= min(budget, STAGING_BYTES)):
                total += views[end][1].nbytes
                end += 1
            staging = self._staging(total)
            reservations: list[Reservation] = _get(
                actor.reserve_batch.remote([(k, v.nbytes) for k, v in views[start:end]])
            )
            ops, fresh, at = [], [], 0
            for r, (key, view), s in zip(reservations, views[start:end], sums[start:end], strict=True):
                if r.already_stored:
                    continue
                staging[at : at + view.nbytes] = view
                ops.append(Op(SEGMENT_NAMES[Tier.DRAM], r.offset, staging.ctypes.data + at, view.nbytes))
                fresh.append((key, *s))
                at += view.nbytes
            try:
                self._transport_().write(peer, ops, timeout_s=self.transfer_timeout_s)
            except BaseException:
                _get(actor.abort_batch.remote([f[0] for f in fresh]))
                raise
            revision = max(revision, int(_get(actor.commit_batch.remote(fresh, replicated))))
            start = end
        return revision

    def _remote_read(self, node_id: str, ops: list[Op]) -> bool:
        """One batched one-sided READ from ``node_id``; False (logged) if the transfer failed."""
        try:
            self._transport_().read(self._peer(node_id), ops, timeout_s=self.transfer_timeout_s)
        except TransferError as exc:
            log.warning("reading from %s failed: %s", node_id[:12], exc)
            self._peers.pop(node_id, None)
            return False
        return True

    def register_buffer(self, buffer: Any) -> None:
        """Register a buffer the caller will ``get_into`` again and again (a KV cache, a pinned pool):
        reads from other nodes into it then land there directly, without a staging copy.  The buffer must
        stay alive until :meth:`unregister_buffer` or :meth:`close`."""
        name, address, nbytes = _buffer_region(buffer)
        if name not in self._registered:
            self._transport_().register(name, address, nbytes)
            self._registered[name] = (address, nbytes)

    def unregister_buffer(self, buffer: Any) -> None:
        name, _, _ = _buffer_region(buffer)
        if self._registered.pop(name, None) is not None:
            self._transport_().deregister(name)

    def _registered_address(self, dest: memoryview) -> int | None:
        """The address of ``dest`` if it lies inside a registered buffer."""
        if not self._registered:
            return None
        address = np.frombuffer(dest, dtype=np.uint8).ctypes.data
        for start, length in self._registered.values():
            if start <= address and address + dest.nbytes <= start + length:
                return int(address)
        return None

    def _transport_(self) -> NixlTransport:
        if self._transport is None:
            self._transport = NixlTransport(scope=self.config.metadata.cluster)
        return self._transport

    def _staging(self, nbytes: int) -> np.ndarray:
        """A buffer registered with the transport, at least ``nbytes`` long (grown on demand)."""
        transport = self._transport_()
        if self._stage is None or self._stage.nbytes < nbytes:
            if self._stage is not None:
                transport.deregister("staging")
            self._stage = np.empty(max(nbytes, 16 << 20), dtype=np.uint8)
            transport.register("staging", self._stage.ctypes.data, self._stage.nbytes)
        return self._stage

    def _peer(self, node_id: str) -> str:
        """The transport peer of a pool node, connected from its descriptor in the node record."""
        if node_id not in self._peers:
            record = next((n for n in self.cache.nodes() if n.node_id == node_id), None)
            if record is None or not record.address:
                raise ChunkNotFound(f"pool node {node_id[:12]} is gone or publishes no transfer address")
            try:
                self._peers[node_id] = self._transport_().connect(record.address)
            except TransferError as exc:
                raise ChunkNotFound(f"pool node {node_id[:12]} cannot be reached: {exc}") from exc
        return self._peers[node_id]

    # -- get -------------------------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes:
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[bytes]) -> list[bytes]:
        buffers = [bytearray(self._replicas(k)[0].raw_size) for k in keys]
        self.get_into_batch(keys, buffers)
        return [bytes(b) for b in buffers]

    def get_into(self, key: bytes, buffer: Any) -> int:
        """Copy the chunk into ``buffer`` (exactly its size); returns the number of bytes."""
        dest = byte_view(buffer, writable=True, field="buffer")
        corrupt: list[Placement] = []
        for replica in self._replicas(key):
            if replica.raw_size != dest.nbytes:
                raise ValueError(
                    f"buffer holds {dest.nbytes} bytes, chunk {short(key)} is {replica.raw_size}: pass a buffer of "
                    "its size"
                )
            try:
                if replica.tier is Tier.REMOTE:
                    [intact] = self._read_remote([replica], [dest])
                else:
                    [intact] = self._read_group(replica.node, [key], [dest])
            except ChunkNotFound:
                continue  # that node is gone
            if intact is None:
                continue  # the placement was stale, or the holder could not be reached
            if intact:
                return dest.nbytes
            log.warning("chunk %s on %s fails its checksum; dropping that replica", short(key), replica.node[:12])
            corrupt.append(replica)
            self._drop_corrupt(replica)
        if corrupt:
            raise CorruptChunk(f"every replica of chunk {short(key)} was corrupt and has been dropped; recompute it")
        raise ChunkNotFound(f"chunk {short(key)}: no replica could be read; recompute it")

    def get_into_batch(
        self, keys: Sequence[bytes], buffers: Sequence[Any], on_done: Callable[[int], None] | None = None
    ) -> list[int]:
        """``get_into`` for many chunks, grouped by the node of their nearest replica: per node one
        actor call pins them all, one copy (same node) or one batched READ (another node) moves them,
        one call releases them.  Anything that does not come back intact goes through :meth:`get_into`
        (next replica, corrupt replicas dropped).  ``on_done(i)`` is called as soon as ``keys[i]`` is in
        its buffer, verified — same-node copies stream, so a caller can start on the first chunks early."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        started = time.perf_counter()
        dests = [byte_view(b, writable=True, field="buffer") for b in buffers]
        done = [False] * len(keys)
        by_node: dict[str, list[int]] = {}
        nearest = [self._replicas(key)[0] for key in keys]
        optimistic = self._read_local_unpinned(nearest, dests, on_done)
        in_remote_tier: list[int] = []
        for i, replica in enumerate(nearest):
            if i in optimistic:
                done[i] = True
            elif replica.tier is Tier.REMOTE:
                in_remote_tier.append(i)
            else:
                by_node.setdefault(replica.node, []).append(i)
        if in_remote_tier:
            got = self._read_remote([nearest[i] for i in in_remote_tier], [dests[i] for i in in_remote_tier])
            for i, intact in zip(in_remote_tier, got, strict=True):
                done[i] = intact is True
                if done[i] and on_done is not None:
                    on_done(i)
        for node_id, idx in by_node.items():
            with contextlib.suppress(ChunkNotFound):  # the holder is gone: get_into tries the next replica
                notify = None if on_done is None else partial(_at, on_done, idx)
                got = self._read_group(node_id, [keys[i] for i in idx], [dests[i] for i in idx], notify)
                for i, intact in zip(idx, got, strict=True):
                    done[i] = intact is True
        for i, key in enumerate(keys):
            if not done[i]:
                self.get_into(key, dests[i])
                if on_done is not None:
                    on_done(i)
        by_source = dict.fromkeys(SOURCES, 0)
        for d, p in zip(dests, nearest, strict=True):
            by_source[self._source(p)] += d.nbytes
        self._seen.get(time.perf_counter() - started, by_source)
        self._report()
        return [d.nbytes for d in dests]

    def get_into_device(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> list[int]:
        """``get_into_batch`` for tensors in device (GPU) memory, each exactly its chunk's size.

        Chunks this node holds raw on NVMe go straight from the segment file into the tensor, pinned on the
        node and not promoted: by GPUDirect Storage where the host has it (``nvme_io_path()``: ``gds``, else
        kvikio's compatibility mode, else O_DIRECT and a host-to-device copy).  Each is verified by its
        checksum over a host copy of what landed; one that fails, and every other chunk, is read into host
        memory the usual way (other replicas, corrupt ones dropped) and copied over.  CPU tensors work too:
        the direct path is then the O_DIRECT read into their memory.  ``device_reads`` counts both paths.
        """
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys but {len(tensors)} tensors")
        flats = [_device_bytes(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
        nearest = [self._replicas(k)[0] for k in keys]
        direct = [
            i for i, p in enumerate(nearest)
            if p.node == self.node_id and p.tier is Tier.NVME and p.codec == "raw" and p.length == flats[i].numel()
        ]  # fmt: skip
        landed: set[int] = set()
        io = self._device_nvme() if direct else None
        if io is not None:
            chunks: list[StoredChunk | None] = _get(self._local.locate_batch.remote([keys[i] for i in direct], False))
            try:
                for i, c in zip(direct, chunks, strict=True):
                    if c is None or c.tier is not Tier.NVME or c.codec != "raw" or c.length != flats[i].numel():
                        continue  # moved since the placement was read: the host path finds it
                    try:
                        io.read_into_device(c.offset, flats[i])
                    except (OSError, KvPoolError) as exc:  # the host path reads it instead
                        log.warning("direct NVMe read of %s failed: %s", short(c.key), exc)
                        continue
                    if checksum(byte_view(flats[i].cpu())) == c.checksum:
                        landed.add(i)
                        self.device_reads["direct"] += 1
                        self.device_reads["direct_bytes"] += c.length
            finally:
                self._local.release_batch.remote([keys[i] for i in direct])
        rest = [i for i in range(len(keys)) if i not in landed]
        if rest:
            hosts = [flats[i] if flats[i].device.type == "cpu" else _host_like(flats[i]) for i in rest]
            self.get_into_batch([keys[i] for i in rest], hosts)
            for i, host in zip(rest, hosts, strict=True):
                if host is not flats[i]:
                    flats[i].copy_(host)
                self.device_reads["via_host"] += 1
                self.device_reads["via_host_bytes"] += host.numel()
        return [f.numel() for f in flats]

    def _device_nvme(self) -> DeviceIO | None:
        """This node's NVMe segment, opened read-only for get_into_device (None: no pool node or no NVMe here)."""
        if self._device_io is None and self._info is not None and self._info.nvme_path:
            segment = NvmeSegment.attach(self._info.nvme_path, self._info.nvme_capacity)
            self._device_io = DeviceIO(segment)
        return self._device_io

    def _source(self, p: Placement) -> str:
        """Where a read comes from, as the metrics name it: this node, another node, or the remote tier."""
        return "remote_tier" if p.tier is Tier.REMOTE else "local" if p.node == self.node_id else "remote"

    def _read_local_unpinned(
        self, nearest: list[Placement], dests: list[memoryview], on_done: Callable[[int], None] | None
    ) -> set[int]:
        """Copy the chunks held in this node's DRAM straight out of the mapped segment at the offsets the
        placements give, with no call to the node; a copy whose checksum does not match (the chunk moved or
        was evicted meanwhile, or is being overwritten) is simply not counted — the pinned path reads it.
        The node is told of the hits afterwards (LRU order, counters), without waiting."""
        if self._segment is None:
            return set()
        read: set[int] = set()
        for i, p in enumerate(nearest):
            if p.node != self.node_id or p.tier is not Tier.DRAM or p.length != dests[i].nbytes:
                continue
            if p.offset + p.length > self._segment.capacity:
                continue
            self._segment.read_into(p.offset, dests[i])
            if checksum(dests[i]) == p.checksum:
                read.add(i)
                if on_done is not None:
                    on_done(i)
        if read:
            self._local.touch_batch.remote([nearest[i].key for i in read])
        return read

    def _read_group(
        self, node_id: str, keys: list[bytes], dests: list[memoryview], on_done: Callable[[int], None] | None = None
    ) -> list[bool | None]:
        """Pin ``keys`` on ``node_id`` (promoting NVMe hits), move their bytes into ``dests``, release them.

        Per key: True (intact), False (checksum mismatch) or None (not read: the node no longer holds
        it, could not be reached, or the size differs).  ``ChunkNotFound`` if the node is gone.
        ``on_done(j)`` as soon as ``keys[j]`` is in place and intact.
        """
        local = node_id == self.node_id and self._segment is not None
        actor = self._local if local else self._actor(node_id)
        chunks: list[StoredChunk | None] = _get(actor.locate_batch.remote(keys))
        result: list[bool | None] = [None] * len(keys)

        def mark(j: int, intact: bool) -> None:
            result[j] = intact
            if intact and on_done is not None:
                on_done(j)

        try:
            usable = [(j, c) for j, c in enumerate(chunks) if c is not None and c.raw_size == dests[j].nbytes]
            if local:
                for j, c in usable:
                    with contextlib.suppress(ChunkNotFound):
                        mark(j, self._copy_local(c, dests[j]))
                return result
            on_nvme = [(j, c) for j, c in usable if c.tier is not Tier.DRAM]  # the transport reaches DRAM only
            if on_nvme:
                copies = _get(actor.read_batch.remote([c.key for _, c in on_nvme]))
                for (j, c), data in zip(on_nvme, copies, strict=True):
                    if data is not None:
                        mark(j, _fill(dests[j], data, c.codec, c.checksum))
            in_dram = [(j, c) for j, c in usable if c.tier is Tier.DRAM]
            addresses = {j: self._registered_address(dests[j]) for j, _ in in_dram}
            direct = [(j, c, a) for j, c in in_dram if (a := addresses[j]) is not None]
            staged = [(j, c) for j, c in in_dram if addresses[j] is None]
            if direct:  # straight into the caller's registered buffers: no staging, no copy
                ops = [Op(SEGMENT_NAMES[Tier.DRAM], c.offset, a, c.length) for _, c, a in direct]
                if not self._remote_read(node_id, ops):
                    return result
                for j, c, _ in direct:
                    mark(j, checksum(dests[j]) == c.checksum)
            while staged:  # rounds of at most STAGING_BYTES (or one chunk), one batched READ each
                rnd: list[tuple[int, StoredChunk]] = []
                total = 0
                while staged and (not rnd or total + staged[0][1].length <= STAGING_BYTES):
                    rnd.append(staged.pop(0))
                    total += rnd[-1][1].length
                staging = self._staging(total)
                ops, at = [], 0
                for _, c in rnd:
                    ops.append(Op(SEGMENT_NAMES[Tier.DRAM], c.offset, staging.ctypes.data + at, c.length))
                    at += c.length
                if not self._remote_read(node_id, ops):
                    return result
                at = 0
                for j, c in rnd:
                    dests[j][:] = staging[at : at + c.length].data
                    mark(j, checksum(dests[j]) == c.checksum)
                    at += c.length
            return result
        finally:
            actor.release_batch.remote(keys)

    def _replicas(self, key: bytes) -> list[Placement]:
        """Nearest first: this node, then DRAM before NVMe before remote."""
        replicas = self.cache.replicas(check_key(key))
        if not replicas:
            raise ChunkNotFound(f"chunk {short(key)} is not in the pool; recompute it")
        return sorted(replicas, key=lambda p: (p.node != self.node_id, p.tier.rank))

    def _copy_local(self, chunk: StoredChunk, dest: memoryview) -> bool:
        """Copy a pinned chunk of this node into ``dest``; whether it came out intact."""
        assert self._segment is not None
        if chunk.tier is not Tier.DRAM:  # not promoted (promote_on_hit off, or DRAM full): read via the node
            [data] = _get(self._local.read_batch.remote([chunk.key]))
            if data is None:
                raise ChunkNotFound(f"chunk {short(chunk.key)} left this node")
            return _fill(dest, data, chunk.codec, chunk.checksum)
        self._segment.read_into(chunk.offset, dest)
        return checksum(dest) == chunk.checksum

    # -- the remote (S3) tier --------------------------------------------------------------------------

    def _remote_store(self) -> RemoteStore | None:
        if self._remote is None and self.config.remote.enabled:
            self._remote = RemoteStore(self.config.remote, self.config.metadata.cluster)
        return self._remote

    def _read_remote(self, replicas: list[Placement], dests: list[memoryview]) -> list[bool | None]:
        """Fetch chunks from the remote tier (concurrently), verify and decode them into ``dests``; per chunk
        True (intact), False (corrupt) or None (not read: the object is gone — its placement is dropped — or
        the remote tier is unavailable, or not configured in this client).  Intact chunks are put back into
        the pool when ``remote.promote_on_hit``."""
        remote = self._remote_store()
        if remote is None:
            log.warning("%d chunks are only in the remote tier, which this client has no config for", len(replicas))
            return [None] * len(replicas)
        with ThreadPoolExecutor(REMOTE_THREADS, thread_name_prefix="kvpool-remote") as pool:
            fetches = [pool.submit(remote.get, p.key, p.codec) for p in replicas]
        out: list[bool | None] = []
        gone: list[Placement] = []
        promote: list[tuple[bytes, Any]] = []
        for p, dest, fetch in zip(replicas, dests, fetches, strict=True):
            try:
                data = fetch.result()
            except ChunkNotFound:
                gone.append(p)
                out.append(None)
                continue
            except RemoteUnavailable as exc:
                log.warning("chunk %s: remote tier unavailable, a miss: %s", short(p.key), exc)
                out.append(None)
                continue
            out.append(_fill(dest, data, p.codec, p.checksum))
            if out[-1] and self.config.remote.promote_on_hit:
                fmt = TensorFormat.of_encoded(data) if p.codec != "raw" else None
                promote.append((p.key, fmt.view(dest) if fmt is not None else dest))
        if gone:
            log.warning("%d remote placements named objects that are gone: dropping them", len(gone))
            with contextlib.suppress(MetadataUnavailable):  # a read does not fail for etcd; the next reader drops them
                self._drop_remote(gone, delete_objects=False)
        if promote and self.cache.nodes():
            try:
                self.put_batch(promote)
            except KvPoolError as exc:  # the read succeeded; only the promotion did not
                log.info("could not promote %d chunks from the remote tier: %s", len(promote), exc)
        return out

    def _drop_remote(self, replicas: Sequence[Placement], *, delete_objects: bool = True) -> None:
        """Delete remote-tier copies: their objects, then their placements (a placement left behind by a
        failure names a missing object, which the next reader drops; an object left behind is ``remote_gc``'s)."""
        if delete_objects and (remote := self._remote_store()) is not None:
            remote.delete([(p.key, p.codec) for p in replicas])
        self.placements.delete(replicas)
        revision = self.etcd.revision()
        self.cache.wait_until(lambda c: c.revision >= revision, timeout_s=self.config.metadata.retry_deadline_s)

    def remote_gc(self, grace_s: float = 3600.0) -> tuple[int, int]:
        """Reconcile the remote tier with etcd (see :func:`collect_garbage`)."""
        remote = self._remote_store()
        if remote is None:
            raise ConfigError("no remote tier configured: set remote.bucket")
        return collect_garbage(remote, self.cache, self.placements, grace_s)

    def _drop_corrupt(self, replica: Placement) -> None:
        if replica.tier is Tier.REMOTE:
            with contextlib.suppress(RemoteUnavailable):
                self._drop_remote([replica])
            return
        try:
            revision = _get(self._actor(replica.node).remove_batch.remote([replica.key], True)).revision
            self.cache.wait_until(lambda c: c.revision >= revision, timeout_s=self.config.metadata.retry_deadline_s)
        except ChunkNotFound:
            pass

    # -- lookups, removal, stats ----------------------------------------------------------------------

    def exists(self, key: bytes) -> bool:
        return bool(self.cache.replicas(check_key(key)))

    def exists_batch(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks of a hash chain the pool holds (no etcd round trip)."""
        held = self.cache.lookup_prefix([check_key(k) for k in keys])
        self.count_lookup(len(keys), held)
        return held

    def count_lookup(self, asked: int, held: int) -> None:
        """Count a prefix lookup of ``asked`` chunks of which the pool held the first ``held`` (the node's
        hit rate); :meth:`lookup_prefix` counts its own, callers that look chunks up otherwise call this."""
        self._seen.lookup(asked, held)
        self._report()

    def _report(self, force: bool = False) -> None:
        """Hand what this client saw (lookups, gets) to its node's metrics, at most about once a second,
        without waiting.  A client on a Ray node with no pool node has nobody to report to."""
        if self._local is None or not self._seen or (not force and time.monotonic() - self._reported_at < 1.0):
            return
        self._local.report_clients.remote(self._seen)
        self._seen, self._reported_at = ClientStats(), time.monotonic()

    def record_engine(self, counts: dict[str, float]) -> None:
        """Add an inference engine connector's counts (see ``ClientStats.engine``) to what this client reports."""
        if not isinstance(counts, dict) or not all(
            isinstance(k, str) and isinstance(n, (int, float)) and not isinstance(n, bool) for k, n in counts.items()
        ):
            raise ConfigError(f"counts must be a dict of names to numbers, got {counts!r:.80}")
        for name, n in counts.items():
            self._seen.engine[name] = self._seen.engine.get(name, 0) + n
        self._report()

    def remove(self, key: bytes) -> bool:
        """Remove every replica; False if the pool did not hold the chunk."""
        return self.remove_batch([key]) == 1

    def remove_batch(self, keys: Sequence[bytes]) -> int:
        """Remove every replica of ``keys`` (one call per holding node, and the remote tier's objects);
        returns how many the pool held."""
        in_remote_tier = [p for key in keys for p in self.cache.replicas(check_key(key)) if p.tier is Tier.REMOTE]
        try:
            return self._per_holder(keys, lambda actor, node_keys: actor.remove_batch.remote(node_keys))
        finally:  # even when some node copies are still being read (ChunkBusy): the caller wants them all gone
            if in_remote_tier:
                self._drop_remote(in_remote_tier)

    def move(self, keys: Sequence[bytes], tier: Tier) -> None:
        """Move every replica of ``keys`` to ``tier`` on its node (e.g. demote to NVMe); returns once the
        local placement cache shows it.  Copies in the remote tier stay where they are."""
        self._per_holder(keys, lambda actor, node_keys: actor.move_batch.remote(node_keys, tier))

    def _per_holder(self, keys: Sequence[bytes], call: Callable[[Any, list[bytes]], Any]) -> int:
        """``call(actor, keys it holds)`` once per node holding a replica of any of ``keys`` (a node gone
        meanwhile is skipped), then wait until the local placement cache shows the etcd revision the calls
        returned.  Returns how many of ``keys`` had a replica.

        A node leaves a chunk that a reader has pinned as it is and names it (:class:`Settled`); those keys
        are asked again, with back-off, until ``config.busy_wait_s`` has passed — then :class:`ChunkBusy`.
        Reads hold their pins only for one transfer, and this client's own releases always reach a node
        before its next call there (Ray runs one caller's calls to an actor in order), so the wait is for
        *other* clients' reads: one that released its pins without waiting, or one still in flight."""
        by_node: dict[str, list[bytes]] = {}
        held = 0
        for key in keys:
            replicas = self.cache.replicas(check_key(key))
            held += bool(replicas)
            for p in replicas:
                if p.tier is not Tier.REMOTE:
                    by_node.setdefault(p.node, []).append(key)
        revision, pause = 0, 0.005
        deadline = time.monotonic() + self.config.busy_wait_s
        while by_node:
            busy: dict[str, list[bytes]] = {}
            for node_id, node_keys in by_node.items():
                with contextlib.suppress(ChunkNotFound):
                    settled: Settled = _get(call(self._actor(node_id), node_keys))
                    revision = max(revision, settled.revision)
                    if settled.busy:
                        busy[node_id] = settled.busy
            by_node = busy
            if by_node and time.monotonic() + pause > deadline:
                keys_left = [k for ks in by_node.values() for k in ks]
                raise ChunkBusy(
                    f"{len(keys_left)} chunks (first {short(keys_left[0])}) were still being read after "
                    f"{self.config.busy_wait_s:g} s (busy_wait_s): retry once those reads end; the rest are done"
                )
            if by_node:
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
        self.cache.wait_until(lambda c: c.revision >= revision, timeout_s=self.config.metadata.retry_deadline_s)
        return held

    @property
    def registrations(self) -> int:
        """Memory regions this client has registered with the transport (staging, caller buffers)."""
        return 0 if self._transport is None else self._transport.registrations

    def stats(self) -> dict[str, Any]:
        nodes = {}
        for n in self.cache.nodes():
            try:
                nodes[n.node_id] = _get(self._actor(n.node_id).stats.remote(), timeout=10)
            except Exception as exc:  # a node dying right now: report, don't fail the whole view
                nodes[n.node_id] = {"error": f"{type(exc).__name__}: {exc}"}
        return {"nodes": nodes, "chunks": self.cache.chunk_count(), "replicas": self.cache.replica_count()}
