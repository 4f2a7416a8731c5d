"""``PoolClient``: put and get KV chunks anywhere in the pool.

Works from a Ray driver, task or actor (``ray.init`` done).  Lookups (``exists``, ``lookup_prefix``, the
replicas of a chunk) are answered by a local watch-synced copy of etcd, without a round trip.  Data:

- **same node**: the client maps its node's DRAM segment (:mod:`~kvpool.pool.client.local`: mapped anew, with the
  node's new actor, once the node was started again); a put writes straight into the room the node holds for
  it and hands the batch over (one call, which opens the next room); a get copies the chunk out of the mapping at
  the offset its placement gives and verifies the checksum — no call at all; only if that fails (the chunk moved or
  is being evicted) does it pin the chunk (one call), copy it and unpin.
- **a peer** (another node): one-sided NIXL/UCX transfers (:mod:`kvpool.transport.nixl`) between a staging
  buffer registered by this client and the holder's registered DRAM segment.  A put WRITEs into the room held on
  the holder and hands the batch over (one call); a get pins the chunk (one call, promoting it from NVMe), READs it
  and unpins.  No KV byte passes through Ray or etcd, except a chunk left on a peer's NVMe (``promote_on_hit`` off,
  or DRAM full), which comes back with the pinning call.
- **the S3 (remote) tier**: a chunk whose only copies are there is fetched by the client itself (boto3,
  several GETs at once), verified, decoded and, with ``remote.promote_on_hit``, put back into the pool.

The paths live in their own modules: :mod:`~kvpool.pool.client.writes` (puts), :mod:`~kvpool.pool.client.reads`
(reads from nodes), :mod:`~kvpool.pool.client.replicas` (which replica, in which order),
:mod:`~kvpool.pool.client.peers` (the transport), :mod:`~kvpool.pool.client.remote_reads` (the remote tier),
:mod:`~kvpool.pool.client.device_reads` (into device memory) and :mod:`~kvpool.pool.protocol` (the typed node calls).  A chunk stored with a codec is verified on
its stored bytes, then decoded into the caller's buffer.  Every read is checked against its placement's checksum: a
mismatch drops that replica (everywhere) and tries the next; if none is intact the caller gets :class:`CorruptChunk`,
a kind of :class:`ChunkNotFound` — a miss, never wrong bytes.
"""

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import ray

from kvpool.core.config import NonNegative, checked
from kvpool.core.keys import CacheIdentity, ChunkKey, check_key, check_keys
from kvpool.core.types import Tier
from kvpool.errors import ConfigError, NodeUnreachable
from kvpool.metadata import identities
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.lookup import PrefixLookup
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore
from kvpool.pool.advisor import AccessLog
from kvpool.pool.buffers import joined, one_per_key, pieces_of, tensor_bytes
from kvpool.pool.chunks import Fingerprint, Origin
from kvpool.pool.client.args import Counts, GraceS, MaybeOnDone, NodeId, NodeIds, NodeTier, ReplicaCount, Tensors
from kvpool.pool.client.device_reads import DeviceReads
from kvpool.pool.client.local import LocalNode
from kvpool.pool.client.peers import Peers, node_record
from kvpool.pool.client.prefetch import Prefetched, plan
from kvpool.pool.client.reads import NodeReads, at, landed, settle
from kvpool.pool.client.remote_reads import RemoteReads
from kvpool.pool.client.replicas import Replicas
from kvpool.pool.client.writes import Item, Rooms, put_local, put_peer, targets
from kvpool.pool.config import PoolConfig
from kvpool.pool.metrics import SOURCES, StatsReporter
from kvpool.pool.protocol import NodeHandle, NodeHandles, NodeInfo, Settled
from kvpool.pool.tenants import TenantName
from kvpool.pool.tiers.codecs import TensorFormat
from kvpool.pool.tiers.s3_config import GC_GRACE_S


class PoolClient:
    """Public methods check their arguments once per call, against declared types (:func:`~kvpool.core.config.checked`
    on the annotations, or ``kvpool.core.keys.check_keys``): a ``ConfigError`` naming the argument and what to pass."""

    @checked
    def __init__(self, config: PoolConfig) -> None:
        if not ray.is_initialized():
            raise ConfigError("PoolClient needs Ray: call ray.init(address=...) first")
        self.access_log = AccessLog.from_env()  #: sampled lookups for kvpool advise (KVPOOL_ACCESS_LOG)
        self._lookup = PrefixLookup(self.access_log)
        self.config = config
        self.node_id = ray.get_runtime_context().get_node_id()
        self.etcd = EtcdClient(config.metadata)
        self.cache = MetadataCache(self.etcd, Namespace(config.metadata.cluster)).start()
        self.placements = PlacementStore(self.etcd, Namespace(config.metadata.cluster))
        #: a node started again is a new actor: its record's process tells (see NodeHandles)
        self.nodes = NodeHandles(config.namespace, lambda n: r.pid if (r := node_record(self.cache, n)) else None)
        self.peers = Peers(self.cache, scope=config.metadata.cluster, fault=self._transfer_fault)
        self.rooms = Rooms(self.cache)  #: DRAM each node holds for this client's next batch
        self._wait_s = config.metadata.retry_deadline_s  #: how long a call waits for the watch cache to catch up
        self.remote = RemoteReads(
            config.remote, config.metadata.cluster, self.cache, self.placements, self.put_batch, self._wait_s
        )
        self.local = LocalNode(self.node_id, self.nodes, self.cache)  #: the pool node here, bound anew once restarted
        self._stats = StatsReporter(self.local.handle)  #: what this client saw, for its node's metrics
        #: its transfer faults by kind, since made: an engine counts them itself too (a node may die with its counts)
        self.transfer_faults: Counter[str] = Counter()
        self.reads = NodeReads(self.node_id, self.nodes, self.peers, self.local, config.encryption.keyring())
        self.device = DeviceReads(self.node_id, self.local)
        self.replicas = Replicas(
            self.node_id, self.cache, self.nodes, self.reads, self.remote, self._wait_s, self._caught_up
        )

    def _transfer_fault(self, kind: str) -> None:
        """A transfer with a peer went wrong (:class:`Peers`): counted for this node's metrics, at once (rare)."""
        self.transfer_faults[kind] += 1
        self._stats.seen.transfer_fault(kind)
        self._stats.report(force=True)

    def close(self) -> None:
        self._stats.report(force=True)
        if self.access_log is not None:
            self.access_log.close()
        self.rooms.close()
        self.peers.close()
        self.remote.close()
        self.cache.close()
        self.etcd.close()
        self.local.close()

    @property
    def info(self) -> NodeInfo | None:
        """What the pool node on this Ray node told of itself (None: there is none)."""
        bound = self.local.current()
        return bound.info if bound is not None else None

    def __enter__(self) -> "PoolClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _caught_up(self, revision: int) -> None:
        self.cache.wait_until(lambda c: c.revision >= revision, timeout_s=self._wait_s)

    # -- put -------------------------------------------------------------------------------------------

    @checked
    def put(self, key: ChunkKey, data: Any, replicas: ReplicaCount = 1) -> None:
        self.put_batch([(key, data)], replicas=replicas)

    @checked
    def put_batch(
        self,
        items: Sequence[tuple[ChunkKey, Any]],
        replicas: ReplicaCount = 1,
        nodes: NodeIds = (),
        tenant: TenantName = "",
        identity: Fingerprint = "",
    ) -> None:
        """Store each ``(key, data)`` on ``replicas`` distinct nodes: this node first when it has a pool
        node, then those with the most free space; or exactly on ``nodes`` when given.  Keys name
        content: a key already held by a target is not written again.  A chunk's data may be a list of buffers: its bytes
        spread over several regions, in order (a run of KV blocks), gathered as they are written.  A chunk given as a
        float tensor (or a list of them, one dtype, one shape but the first dimension) carries its format, so tiers
        with a codec can encode it; bytes are stored raw everywhere.  ``tenant``: whose
        chunks they are (its quota, its metrics; ``Scope.tenant`` of the keys' chain); ``identity``: the fingerprint of
        the cache identity the keys were made under (:meth:`register_identity` returns it), which the placements and
        the chunk events carry ("": none)."""
        origin = Origin(tenant, identity)
        data = pieces_of([d for _, d in items], writable=False, field="items' data")
        views = [(k, pieces) for (k, _), pieces in zip(items, data, strict=True)]
        live = {n.node_id for n in self.cache.nodes()}
        if unknown := [n for n in nodes if n not in live]:
            raise NodeUnreachable(f"no live pool node {', '.join(u[:12] for u in unknown)}: pick from kvpool status")
        bound = self.local.current()
        here = self.node_id if bound is not None else None
        chosen = list(dict.fromkeys(nodes)) or targets(self.cache.nodes(), here, replicas)
        formats = [TensorFormat.of_pieces(d) for _, d in items]
        replicated = len(chosen) > 1
        local = bound if self.node_id in chosen else None
        with ThreadPoolExecutor(1, thread_name_prefix="kvpool-put") as pool:  # this node's copy beside the peers'
            mine = None
            if local is not None:
                mine = pool.submit(
                    put_local, local.handle, self.node_id, self.rooms, local.segment, views, formats, replicated, origin
                )
            revision = 0
            for node_id in chosen:
                if node_id != self.node_id or local is None:  # peers one at a time: they share the staging buffer
                    revision = max(revision, self._put_peer(node_id, views, formats, replicated, origin))
            if mine is not None:
                revision = max(revision, mine.result())
        self._caught_up(revision)

    def _put_peer(
        self, node_id: str, views: list[Item], formats: list[TensorFormat | None], replicated: bool, origin: Origin
    ) -> int:
        record = node_record(self.cache, node_id)
        if record is None:  # it left the pool since the put chose it
            raise NodeUnreachable(f"pool node {node_id[:12]} left the pool during the put; put again")
        dram = record.capacity(Tier.DRAM)
        return put_peer(self.nodes[node_id], node_id, self.rooms, self.peers, dram, views, formats, replicated, origin)

    def register_buffer(self, buffer: Any) -> None:
        """Register a buffer the caller will ``get_into`` again and again (a KV cache, a pinned pool):
        reads from peers into it then land there directly, without a staging copy.  The buffer must
        stay alive until :meth:`unregister_buffer` or :meth:`close`."""
        self.peers.register(buffer)

    def unregister_buffer(self, buffer: Any) -> None:
        self.peers.unregister(buffer)

    # -- get -------------------------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes:
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[bytes]) -> list[bytes]:
        keys = check_keys(keys)
        buffers = [bytearray(r[0].size) for r in self.replicas.of(keys)]
        self.get_into_batch(keys, buffers)
        return [bytes(b) for b in buffers]

    def get_into(self, key: bytes, buffer: Any) -> int:
        """Copy the chunk into ``buffer`` (exactly its size); returns the number of bytes.  The same path as
        :meth:`get_into_batch` (a chunk in this node's DRAM is copied with no call to the node)."""
        return self.get_into_batch([key], [buffer])[0]

    @checked
    def get_into_batch(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Any], on_done: MaybeOnDone = None
    ) -> list[int]:
        """``get_into`` for many chunks, grouped by the node of their nearest replica: per node one
        actor call pins them all, one copy (same node) or one batched READ (a peer) moves them,
        one call releases them.  Anything that does not come back intact goes through :meth:`get_into`
        (next replica, corrupt replicas dropped).  ``on_done(i)`` is called as soon as ``keys[i]`` is in
        its buffer, verified — same-node copies stream, so a caller can start on the first chunks early.  A buffer may
        be a list of buffers, one chunk spread over them in order (a run of KV blocks): a same-node copy lands there
        directly, and so do READs from a peer into buffers registered with :meth:`register_buffer`."""
        one_per_key(keys, buffers, "buffer")
        started = time.perf_counter()
        pieces = pieces_of(buffers)
        nearest = [r[0] for r in self.replicas.of(keys)]
        done = [False] * len(keys)
        for i in self.reads.unpinned(nearest, pieces, on_done):
            done[i] = True
        in_remote = [i for i, p in enumerate(nearest) if not done[i] and p.tier is Tier.REMOTE]
        by_node: dict[str, list[int]] = {}
        for i, p in enumerate(nearest):
            if not done[i] and p.tier is not Tier.REMOTE:
                by_node.setdefault(p.node, []).append(i)
        if in_remote:  # objects come whole: into each chunk's one buffer, or a scratch one scattered into its pieces
            flat = {i: joined(pieces[i]) for i in in_remote}
            got = self.remote.read([nearest[i] for i in in_remote], [flat[i] for i in in_remote])
            settle(in_remote, got, done, lambda i: landed(flat[i], pieces[i], i, on_done))
        for node_id, idx in by_node.items():
            with contextlib.suppress(NodeUnreachable):  # the holder is gone: get_into tries the next replica
                called = partial(at, on_done, idx) if on_done is not None else None
                settle(idx, self.reads.pinned(node_id, [keys[i] for i in idx], [pieces[i] for i in idx], called), done)
        for i, key in enumerate(keys):
            if not done[i]:
                one = joined(pieces[i])
                self.replicas.read_any(key, one)
                landed(one, pieces[i], i, on_done)
        sizes = [sum(p.nbytes for p in ps) for ps in pieces]
        by_source = dict.fromkeys(SOURCES, 0)
        for size, p in zip(sizes, nearest, strict=True):
            by_source[self.replicas.source(p)] += size
        self._stats.seen.get(time.perf_counter() - started, by_source)
        self._stats.report()
        return sizes

    @checked
    def get_into_device(self, keys: Sequence[ChunkKey], tensors: Tensors) -> list[int]:
        """``get_into_batch`` for tensors in device (GPU) memory, each exactly its chunk's size.

        Chunks this node holds raw on NVMe go straight from the segment file into the tensor (see
        :mod:`~kvpool.pool.client.device_reads`); every other chunk, and one that fails its checksum, is read into host
        memory the usual way and copied over.  CPU tensors work too: the direct path is then the O_DIRECT read
        into their memory.  ``device_reads`` counts both paths."""
        one_per_key(keys, tensors, "tensor")
        flats = [tensor_bytes(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
        self.device.get_into(keys, flats, [r[0] for r in self.replicas.of(keys)], self.get_into_batch)
        return [f.numel() for f in flats]

    @property
    def device_reads(self) -> dict[str, int]:
        return self.device.counts

    @checked
    def remote_gc(self, grace_s: GraceS = GC_GRACE_S) -> tuple[int, int]:
        """Reconcile the remote tier with etcd (see :func:`~kvpool.pool.tiers.s3.collect_garbage`)."""
        return self.remote.gc(grace_s)

    # -- lookups, removal, stats ----------------------------------------------------------------------

    def exists(self, key: bytes) -> bool:
        return bool(self.cache.replicas(check_key(key)))

    def exists_batch(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.exists(k) for k in check_keys(keys)]

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks of a hash chain the pool holds (no etcd round trip); counted for the node's hit
        rate, a short one under its miss cause, and logged for ``kvpool advise`` when ``KVPOOL_ACCESS_LOG`` is set."""
        hit = self._lookup(self.cache, [[key] for key in check_keys(keys)])
        self.count_lookup(hit.asked, hit.held)
        if hit.cause is not None:
            self._stats.seen.miss(hit.cause.value)
            self._stats.report()
        return hit.held

    @checked
    def count_lookup(self, asked: NonNegative, held: NonNegative) -> None:
        """Count a prefix lookup of ``asked`` chunks of which the pool held the first ``held`` (the node's
        hit rate); :meth:`lookup_prefix` counts its own, callers that look chunks up otherwise call this."""
        if held > asked:
            raise ConfigError(f"count_lookup takes held <= asked, got asked={asked}, held={held}")
        self._stats.seen.lookup(asked, held)
        self._stats.report()

    @checked
    def record_engine(self, counts: Counts) -> None:
        """Add an inference engine connector's counts (see ``ClientStats.engine``) to what this client reports, sent to
        its node at once (one call not waited for; connectors call this at most once a load or save batch), so a
        count is never held back until the client's next call, which an idle engine may not make."""
        self._stats.seen.add_engine(counts)
        self._stats.report(force=True)

    @checked
    def register_identity(self, identity: CacheIdentity) -> str:
        """Say that this client's chunks are keyed from ``identity`` (``kvpool status`` lists the identities in use
        and warns when two of one model differ); its fingerprint.  Connectors call it when they start."""
        return identities.register(self.etcd, self.cache.namespace, identity)

    def remove(self, key: bytes) -> bool:
        """Remove every replica; False if the pool did not hold the chunk."""
        return self.remove_batch([key]) == 1

    def remove_batch(self, keys: Sequence[bytes]) -> int:
        """Remove every replica of ``keys`` (one call per holding node, and the remote tier's objects);
        returns how many the pool held."""
        keys = check_keys(keys)
        in_remote = [p for key in keys for p in self.cache.replicas(key) if p.tier is Tier.REMOTE]
        try:
            return self._per_holder(keys, lambda node, node_keys: node.remove(node_keys))
        finally:  # even when some node copies are still being read (ChunkBusy): the caller wants them all gone
            if in_remote:
                self.remote.drop(in_remote)

    @checked
    def move(self, keys: Sequence[ChunkKey], tier: NodeTier) -> None:
        """Move every replica of ``keys`` to ``tier`` on its node (e.g. demote to NVMe); returns once the
        local placement cache shows it.  Copies in the remote tier stay where they are."""
        if tier not in (Tier.DRAM, Tier.NVME):
            raise ConfigError(f"tier must be Tier.DRAM or Tier.NVME (a copy moves between a node's tiers), got {tier}")
        self._per_holder(keys, lambda node, node_keys: node.move(node_keys, tier))

    def _per_holder(self, keys: Sequence[bytes], change: Callable[[NodeHandle, list[bytes]], Settled]) -> int:
        """``change(node, keys it holds)`` once per node holding a replica of any of ``keys`` (a node gone
        meanwhile is skipped), then wait until the local placement cache shows the etcd revision the calls
        returned.  Returns how many of ``keys`` had a replica.

        Keys a reader had pinned are asked again for up to ``config.busy_wait_s`` (see
        :meth:`~kvpool.pool.protocol.NodeHandles.settle`), then :class:`ChunkBusy`."""
        by_node: dict[str, list[bytes]] = {}
        held = 0
        for key in keys:
            replicas = self.cache.replicas(check_key(key))
            held += bool(replicas)
            for p in replicas:
                if p.tier is not Tier.REMOTE:
                    by_node.setdefault(p.node, []).append(key)
        revision = self.nodes.settle(by_node, change, self.config.busy_wait_s)
        self._caught_up(revision)
        return held

    @checked
    def prefetch(self, keys: Sequence[ChunkKey], node: NodeId = "", tenant: TenantName = "") -> Prefetched:
        """Bring the leading run of ``keys`` the pool holds into ``node``'s DRAM (default: this client's node) before a
        reader there asks (:mod:`~kvpool.pool.client.prefetch`): its NVMe copies promoted there, the rest read here
        and put there, charged to ``tenant``.  ``NodeUnreachable`` for a node not in the pool, ``PoolFull`` when its
        DRAM has no room."""
        node = node or self.node_id
        todo = plan(keys, [self.cache.replicas(k) for k in keys], node, {n.node_id for n in self.cache.nodes()})
        if todo.promote:
            self._caught_up(
                self.nodes.settle({node: todo.promote}, lambda n, ks: n.move(ks, Tier.DRAM), self.config.busy_wait_s)
            )
        for identity, group in todo.copy.items():
            self.put_batch(
                list(zip(group, self.get_batch(group), strict=True)), nodes=[node], tenant=tenant, identity=identity
            )
        copied = sum(map(len, todo.copy.values()))
        return Prefetched(todo.already, len(todo.promote), copied, todo.not_held, todo.nbytes)

    @property
    def registrations(self) -> int:  # memory regions registered with the transport (staging, caller buffers)
        return self.peers.registrations

    def connect_peers(self) -> int:
        """Reach every live pool node now (actor handle and first call, transport, staging buffer), not on the first
        transfer there; the peers connected.  Engines call it at start, so a first request pays for none of it."""
        for record in self.cache.nodes():
            with contextlib.suppress(NodeUnreachable):
                self.nodes[record.node_id].info()
        return self.peers.connect_all(self.node_id)

    def stats(self) -> dict[str, Any]:
        nodes = self.nodes.stats([n.node_id for n in self.cache.nodes()], timeout_s=10)
        return {"nodes": nodes, "chunks": self.cache.chunk_count(), "replicas": self.cache.replica_count()}
