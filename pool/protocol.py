"""The wire between the two sides of the pool: the calls a client (:mod:`kvpool.pool.client`) makes on a node's
``PoolNode`` actor (:mod:`kvpool.pool.node`), with real signatures, and the records that cross it.

The node's verbs are those of vLLM's ``OffloadingManager`` (``vllm/v1/kv_offload/abstract.py``) where the mapping
is honest:

================  ======================================================================================
vLLM              kvpool node call
================  ======================================================================================
lookup            none on the node: ``PoolClient.lookup_prefix`` answers from the watch-synced etcd cache
prepare_store     :meth:`NodeHandle.prepare_store`: DRAM room for a writer's next batch (a :class:`Room`)
complete_store    :meth:`NodeHandle.complete_store`: the chunks written into the room become visible (and
                  the next room opens in the same reply); ``success=False`` is :meth:`NodeHandle.abort_store`
prepare_load      :meth:`NodeHandle.prepare_load`: pin chunks for a reader (NVMe hits promoted first), with
                  the bytes of those left on NVMe when asked (the transport reaches DRAM only)
complete_load     :meth:`NodeHandle.complete_load`: release what ``prepare_load`` pinned (not waited for)
touch             :meth:`NodeHandle.touch`: hits a same-node client read without pinning (LRU, counters)
================  ======================================================================================

and besides them ``remove``, ``move`` (between tiers), ``info``, ``stats``, ``audit``, ``reap``, ``flush``,
``report_clients`` and ``shutdown``.

Arguments are checked once, where they arrive, against declared types (``kvpool.core.config.validated``: a room's
length, an :class:`~kvpool.pool.chunks.Origin`, itself checked again when unpickled), and what a writer says it put
into a room is decoded into :class:`Filled` records by ``msgspec`` (:meth:`Room.checked`), since Ray unpickles plain
tuples without any check.  (``@checked`` does not fit an actor's methods: Ray pickles the actor class by value.)
A node's own refusal (a :class:`~kvpool.errors.KvPoolError` raised inside the actor) comes back as itself; a node
that is dead, stopped, or does not answer within the timeout is :class:`~kvpool.errors.NodeUnreachable`
(:func:`call`).  Nothing else in the client catches a Ray exception.
"""

import contextlib
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Annotated, Any

import msgspec
import ray
from ray.actor import ActorHandle

from kvpool.core.config import validated
from kvpool.core.keys import KEY_BYTES
from kvpool.core.types import Tier
from kvpool.errors import ChunkBusy, ConfigError, KvPoolError, NodeUnreachable
from kvpool.pool.chunks import Origin, StoredChunk, short
from kvpool.pool.tiers.codecs import TensorFormat

CALL_TIMEOUT_S = 60.0  #: a node call that has not answered by then counts as the node being unreachable


def actor_name(node_id: str) -> str:
    return f"kvpool-node-{node_id}"


class NodeInfo(msgspec.Struct, frozen=True):
    """What a node tells a client on the same Ray node, so the client can map its segments."""

    node_id: str
    dram_path: str  #: the shared-memory file a same-node client maps
    dram_capacity: int
    nvme_capacity: int
    nvme_direct: bool  #: O_DIRECT in use on the NVMe segment
    nvme_path: str  #: the NVMe segment's file ("" without one), which a same-node client reads into device memory
    metrics_address: str  #: host:port of its Prometheus endpoint ("" if off)
    restart: str = ""  #: what it took back of its last run's NVMe chunks (warm restart; "" if nothing was there)
    pid: int = 0  #: its process, as its node record names it: a node started again is another process


class Settled(msgspec.Struct, frozen=True):
    """What a batch of moves or removes left behind: the etcd revision that shows it, and the keys left as
    they were because a reader had them pinned (the caller waits for the read and asks again)."""

    revision: int
    busy: list[bytes]


class Filled(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A chunk a writer put into a room: its key, where (an offset in the segment), its length, the checksum of
    its bytes and its tensor format (None: bytes).  Sent as a plain tuple, decoded by :meth:`Room.checked`."""

    key: Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    length: Annotated[int, msgspec.Meta(gt=0)]
    checksum: Annotated[int, msgspec.Meta(ge=0)]
    fmt: TensorFormat | None


class Room(msgspec.Struct, frozen=True):
    """DRAM a writer holds for its next batch, whose keys it does not know yet: it writes chunks into it at
    offsets of its choosing (multiples of ``alignment``) and hands them over with one call, which opens the
    next room in the same reply.  A room not handed over within the reservation TTL is reclaimed."""

    id: int
    offset: int
    length: int
    alignment: int
    ttl_s: float = 30.0  #: the holder reclaims it this long after it opened it, unless filled
    at: float = 0.0  #: when it was opened (the store's monotonic clock)
    #: the node's process that opened it, as its node record names it (0: not known): a node started again since is
    #: another process, whose chunks may lie at these offsets, so the writer writes only while the record names this one
    pid: int = 0

    def carve(self, sizes: list[int]) -> list[int] | None:
        """Offsets in the segment for chunks of ``sizes``, laid one after the other on ``alignment``
        boundaries; None when they do not fit."""
        offsets, at = [], self.offset
        for size in sizes:
            offsets.append(at)
            at += -(-size // self.alignment) * self.alignment
        return offsets if at <= self.offset + self.length else None

    def checked(self, items: object) -> list[Filled]:
        """``items``, the chunks a writer says it put here, decoded (:class:`Filled`), if each lies inside this room
        on an ``alignment`` boundary, matches its format's size, and none overlaps another; ``ConfigError``
        otherwise."""
        out = validated(list[Filled], items, "items")
        for c in out:
            if c.offset % self.alignment or not self.offset <= c.offset <= c.offset + c.length <= self.end:
                raise ConfigError(
                    f"chunk {short(c.key)} at [{c.offset}, +{c.length}) is not inside room {self.id} "
                    f"[{self.offset}, +{self.length}) on a {self.alignment}-byte boundary"
                )
            if c.fmt is not None and c.fmt.nbytes != c.length:
                raise ConfigError(f"chunk {short(c.key)}: its format {c.fmt} does not describe {c.length} bytes")
        spans = sorted((c.offset, c.offset + c.length) for c in out)
        if any(end > start for (_, end), (start, _) in pairwise(spans)):
            raise ConfigError(f"chunks put into room {self.id} overlap")
        return out

    @property
    def end(self) -> int:
        return self.offset + self.length


class Stored(msgspec.Struct, frozen=True):
    """What ``complete_store`` answers: the etcd revision that shows the chunks, and the writer's next room (None:
    none was asked for, or DRAM has no space for it now)."""

    revision: int
    next_room: Room | None


class Loaded(msgspec.Struct, frozen=True):
    """What ``prepare_load`` answers, per key asked: the chunk, pinned for the reader (None: not held there), and,
    when the reader asked for them (``copy_nvme``: a peer, whose transport reaches DRAM only), the stored bytes of a
    chunk left on NVMe (None for the others)."""

    chunks: list[StoredChunk | None]
    copies: list[bytes | None]


def call(ref: ray.ObjectRef, timeout_s: float | None = CALL_TIMEOUT_S) -> Any:
    """The result of a node call (``ray.get``): the node's own kvpool error re-raised as itself, a dead or
    silent node as ``NodeUnreachable``."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, KvPoolError):
            raise exc.cause from None
        raise
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
        raise NodeUnreachable(f"pool node unreachable ({type(exc).__name__}): it died or is overloaded") from exc


class NodeHandle:
    """One ``PoolNode`` actor, its calls typed.  The methods that return nothing (``abort_store``,
    ``complete_load``, ``touch``, ``report_clients``) are sent without waiting: Ray runs one caller's calls to an
    actor in order, so they reach the node before that caller's next call there."""

    def __init__(self, node_id: str, actor: ActorHandle) -> None:
        self.node_id, self.actor = node_id, actor
        self.dead = False  #: a call found the actor dead: :class:`NodeHandles` looks the node's actor up again
        self.pid: int | None = None  #: the process the node's record named when this handle was looked up

    def _call(self, ref: ray.ObjectRef, timeout_s: float | None = CALL_TIMEOUT_S) -> Any:
        """:func:`call`, noting an actor found dead (a node started again on this Ray node is a new actor)."""
        try:
            return call(ref, timeout_s)
        except NodeUnreachable as exc:
            self.dead = self.dead or isinstance(exc.__cause__, ray.exceptions.RayActorError)
            raise

    def info(self) -> NodeInfo:
        info: NodeInfo = self._call(self.actor.info.remote())
        return info

    def prepare_store(self, length: int) -> Room:
        room: Room = self._call(self.actor.prepare_store.remote(length))
        return room

    def complete_store(
        self, room: Room, chunks: Sequence[Filled], replicated: bool, origin: Origin, next_length: int
    ) -> Stored:
        wire = [msgspec.structs.astuple(c) for c in chunks]
        stored: Stored = self._call(self.actor.complete_store.remote(room.id, wire, replicated, next_length, origin))
        return stored

    def abort_store(self, room_id: int) -> None:
        self.actor.abort_store.remote(room_id)

    def prepare_load(self, keys: list[bytes], promote: bool | None = None, copy_nvme: bool = False) -> Loaded:
        loaded: Loaded = self._call(self.actor.prepare_load.remote(keys, promote, copy_nvme))
        return loaded

    def complete_load(self, keys: list[bytes]) -> None:
        self.actor.complete_load.remote(keys)

    def touch(self, keys: list[bytes]) -> None:
        self.actor.touch.remote(keys)

    def remove(self, keys: list[bytes], corrupt: bool = False) -> Settled:
        settled: Settled = self._call(self.actor.remove.remote(keys, corrupt))
        return settled

    def move(self, keys: list[bytes], tier: Tier) -> Settled:
        settled: Settled = self._call(self.actor.move.remote(keys, tier))
        return settled

    def report_clients(self, stats: object) -> None:
        self.actor.report_clients.remote(stats)

    def stats(self, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        figures: dict[str, Any] = self._call(self.actor.stats.remote(), timeout_s)
        return figures

    def audit(self) -> list[str]:
        problems: list[str] = self._call(self.actor.audit.remote())
        return problems


class NodeHandles:
    """The actor handles of the pool's nodes in one Ray namespace, looked up once each, and again after one died or
    its record (``pid_of``: the process a node's record names, None if unknown) names another process."""

    def __init__(self, namespace: str, pid_of: Callable[[str], int | None] = lambda _: None) -> None:
        self.namespace, self.pid_of = namespace, pid_of
        self._handles: dict[str, NodeHandle] = {}

    def __getitem__(self, node_id: str) -> NodeHandle:
        """The node's handle, looked up again once a call found its actor dead or the node's record names a process
        the handle was not looked up for (the node was started again: a new actor, which no call may have found
        yet, e.g. when the old one's last call failed on its transfer rather than on the actor)."""
        handle, pid = self._handles.get(node_id), self.pid_of(node_id)
        if handle is None or handle.dead or (pid is not None and handle.pid != pid):
            return self.renew(node_id, pid)
        return handle

    def renew(self, node_id: str, pid: int | None = None) -> NodeHandle:
        """The node's handle, looked up now: the actor that holds its name today (one started again is another);
        ``pid``: the process the node's record names now."""
        try:
            actor = ray.get_actor(actor_name(node_id), namespace=self.namespace)
        except ValueError:  # Ray's way of saying there is no such actor
            raise NodeUnreachable(
                f"no pool node actor for node {node_id[:12]} (it died or was stopped): see kvpool status"
            ) from None
        self._handles[node_id] = handle = NodeHandle(node_id, actor)
        handle.pid = pid
        return handle

    def stats(self, node_ids: Sequence[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        """Each node's :meth:`NodeHandle.stats`, or ``{"error": ...}`` for one dying right now (the view goes on)."""
        out: dict[str, dict[str, Any]] = {}
        for node_id in node_ids:
            try:
                out[node_id] = self[node_id].stats(timeout_s=timeout_s)
            except Exception as exc:  # a node dying right now: report, don't fail the whole view
                out[node_id] = {"error": f"{type(exc).__name__}: {exc}"}
        return out

    def settle(
        self, by_node: dict[str, list[bytes]], change: Callable[[NodeHandle, list[bytes]], Settled], wait_s: float
    ) -> int:
        """``change(node, its keys)`` once per node of ``by_node`` (a node gone meanwhile is skipped); the etcd
        revision that shows what the calls changed.

        A node leaves a chunk that a reader has pinned as it is and names it (:class:`Settled`); those keys are
        asked again, with back-off (5 ms doubling to 0.5 s), until ``wait_s`` has passed — then ``ChunkBusy``.
        Reads hold their pins only for one transfer, and a client's own releases always reach a node before its
        next call there (Ray runs one caller's calls to an actor in order), so the wait is for *other* clients'
        reads: one that released its pins without waiting, or one still in flight."""
        revision, pause = 0, 0.005
        deadline = time.monotonic() + wait_s
        while by_node:
            busy: dict[str, list[bytes]] = {}
            for node_id, node_keys in by_node.items():
                with contextlib.suppress(NodeUnreachable):
                    settled = change(self[node_id], node_keys)
                    revision = max(revision, settled.revision)
                    if settled.busy:
                        busy[node_id] = settled.busy
            by_node = busy
            if by_node and time.monotonic() + pause > deadline:
                left = [k for ks in by_node.values() for k in ks]
                raise ChunkBusy(
                    f"{len(left)} chunks (first {short(left[0])}) were still being read after {wait_s:g} s "
                    "(busy_wait_s): retry once those reads end; the rest are done"
                )
            if by_node:
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
        return revision
