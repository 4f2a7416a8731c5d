"""One node's chunks: its DRAM and NVMe segments, their allocators and the eviction policy.

Plain logic and local I/O only: no etcd, no Ray.  Every operation records :class:`Change` entries that
the caller (the ``PoolNode`` actor) drains with :meth:`ChunkStore.take_changes` and publishes to etcd, so
the placement records follow the bytes.

Life of a chunk: bytes written into a :class:`~kvpool.pool.protocol.Room` a writer opened before it knew the keys
(``open_room``; a same-node client writes straight into the mapped segment, a peer one-sided) → ``fill_room``
(visible; one call per batch; ``put`` is the same path for one chunk) → maybe migrated to NVMe
when DRAM passes its high watermark, promoted back on a hit → dropped when a full tier needs room or on
``remove``.  A chunk pinned by a reader is never moved or dropped.

Tiers below DRAM may store chunks with a codec (``codecs``, e.g. NVMe ``fp8-e4m3``): a chunk put as a tensor
(it carries a :class:`~kvpool.pool.tiers.codecs.TensorFormat`) is encoded when it moves down and decoded when it is
promoted; its checksum is verified before either, so a corrupt chunk is dropped, never re-encoded into
"valid" bytes.  A chunk put as plain bytes stays raw, unless NVMe is encrypted (``keyring``): then every chunk
there, bytes or tensor, is sealed after its codec (pool/tiers/crypto.py).  DRAM is always raw: readers copy it
one-sided, straight into their buffers.
"""

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence

from msgspec.structs import replace

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.core.keys import check_key
from kvpool.core.types import DropCause, Tier
from kvpool.errors import ChunkBusy, ChunkNotFound, ConfigError
from kvpool.pool.chunks import Change, ChangeKind, ChunkState, Origin, StoredChunk, short
from kvpool.pool.config import Watermarks
from kvpool.pool.node.allocator import OffsetAllocator
from kvpool.pool.node.eviction import EvictionPolicy
from kvpool.pool.node.holds import Holds
from kvpool.pool.node.move_books import MoveBooks
from kvpool.pool.node.moves import read_stored
from kvpool.pool.protocol import Filled, Room
from kvpool.pool.segment import DramSegment, NvmeSegment
from kvpool.pool.tiers.codecs import TensorFormat, parse_codec
from kvpool.pool.tiers.crypto import Keyring

log = logging.getLogger(__name__)


COUNTERS = (  #: what a store counts (``ChunkStore.counters``), from 0
    "puts",
    "gets",
    "misses",
    "migrations",
    "promotions",
    "drops",
    "corrupt",
    "reaped",
    "busy",  #: moves and removes refused because a reader had the chunk pinned
    "quota_drops",  #: chunks dropped because their tenant was over its quota
    "encoded",
    "decoded",  #: chunks re-stored with another codec on a move (down, up)
    "bytes_via_ray",  #: KV bytes that came or went as Ray call arguments/results, not one-sided
)


class ChunkStore:
    """One node's chunks: writes, reads and removes; where they go between tiers is kept by ``moves``
    (:class:`~kvpool.pool.node.move_books.MoveBooks`)."""

    def __init__(
        self,
        dram: DramSegment,
        nvme: NvmeSegment | None = None,
        *,
        watermarks: Watermarks | None = None,
        alignment: int = 4096,
        clock: Clock = SYSTEM_CLOCK,
        codecs: Mapping[Tier, str] | None = None,
        demote_inline: bool = True,
        keyring: Keyring | None = None,
        quotas: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        self.segments: dict[Tier, DramSegment | NvmeSegment] = {Tier.DRAM: dram}
        self.allocators = {Tier.DRAM: OffsetAllocator(dram.capacity, alignment)}
        if nvme is not None and nvme.capacity >= alignment:
            self.segments[Tier.NVME] = nvme
            self.allocators[Tier.NVME] = OffsetAllocator(nvme.capacity, alignment)
        by_tier = {t: parse_codec(c).name for t, c in (codecs or {}).items()}
        if by_tier.get(Tier.DRAM, "raw") != "raw":
            raise ConfigError(
                "the DRAM tier stores chunks raw (readers copy them one-sided); put codecs on NVMe or remote"
            )
        self.quotas = dict(quotas or {})  #: tenant -> (DRAM bytes, NVMe bytes) it may hold here; 0: no limit
        self.watermarks = watermarks or Watermarks()
        self.demote_inline = demote_inline  #: a commit above the high watermark demotes at once (else: ``over_high``)
        self.over_high = threading.Event()  #: set by a commit or promotion that left DRAM above its high watermark
        self.clock = clock
        self.policy = EvictionPolicy(clock)
        self._chunks: dict[bytes, StoredChunk] = {}
        self.holds = Holds(self.allocators[Tier.DRAM], clock)  #: DRAM given to writers, not yet chunks
        self._changes: list[Change] = []  #: since the last take_changes()
        self.counters = dict.fromkeys(COUNTERS, 0)
        #: moves between tiers, the room a full tier makes, tenants' quotas: all kept in step with the above
        self.moves = MoveBooks(
            self.segments,
            self.allocators,
            self.policy,
            self._chunks,
            self._changes,
            self.counters,
            codecs=by_tier,
            keyring=keyring,
            quotas=self.quotas,
            watermarks=self.watermarks,
            over_high=self.over_high,
        )

    # -- writing ---------------------------------------------------------------------------------------

    def reap(self) -> int:
        """Give back the space of rooms past their own TTL (their writer died, or kept them idle); returns how many."""
        reaped = self.holds.reap()
        self.counters["reaped"] += reaped
        return reaped

    def open_room(self, length: int, ttl_s: float) -> Room:
        """DRAM room of ``length`` bytes for a writer's next batch, making room by migration or drops if needed;
        reclaimed by :meth:`reap` ``ttl_s`` after this unless filled."""
        return self.holds.open_room(self.moves.allocate(Tier.DRAM, length), ttl_s)

    def close_room(self, room_id: int) -> None:
        """Give a room's space back; an unknown room is left alone (cleanup goes on past it)."""
        self.holds.close_room(room_id)

    def fill_room(self, room_id: int, items: object, *, replicated: bool = False, origin: Origin = Origin()) -> None:
        """Make the chunks a writer put into room ``room_id`` visible as ``origin``'s (see ``Room.checked``); the rest
        of the room is freed.  A key held already keeps its first copy.  Everything is checked before anything changes:
        on bad input the room is closed and nothing is stored (``ConfigError``); a room reclaimed meanwhile is a
        ``ChunkNotFound`` (write the batch again)."""
        room = self.holds.room(room_id)
        if room is None:
            raise ChunkNotFound(
                f"room {room_id!r:.20} is not open here (idle past the reservation TTL, or the node restarted): "
                "put the batch again"
            )
        try:
            checked = room.checked(items)
        finally:
            self.close_room(room_id)
        first: dict[bytes, Filled] = {}  # a key twice: its first copy
        for c in checked:
            if c.key not in self._chunks:
                first.setdefault(c.key, c)
        for c in first.values():  # all claimed before an addition may demote anything
            self.allocators[Tier.DRAM].claim(c.offset, c.length)
        for c in first.values():
            chunk = StoredChunk(c.key, Tier.DRAM, c.offset, c.length, c.length, c.checksum, fmt=c.fmt, origin=origin)
            self._add(chunk, replicated)

    def _add(self, chunk: StoredChunk, replicated: bool) -> None:
        """A chunk filled in DRAM becomes visible (then migrates by watermark and by its tenant's quota)."""
        self._chunks[chunk.key] = chunk
        size = self.allocators[Tier.DRAM].size_of(chunk.offset)
        self.policy.add(chunk.key, Tier.DRAM, size, replicated=replicated, tenant=chunk.tenant)
        self.counters["puts"] += 1
        self._changes.append(Change(ChangeKind.ADDED, chunk))
        if self.demote_inline:
            self.moves.maintain()
        elif self.moves.over_high_watermark() or self.policy.over_quota(self.quotas, Tier.DRAM):
            self.over_high.set()
        self.moves.trim_quotas()

    def put(
        self,
        key: bytes,
        data: memoryview,
        checksum: int,
        *,
        replicated: bool = False,
        fmt: TensorFormat | None = None,
        origin: Origin = Origin(),
        ttl_s: float = 30.0,
    ) -> StoredChunk | None:
        """One chunk by the writers' path, for a caller in this process (benchmarks, tests): a room, the bytes
        written into it, the fill.  What the store holds under ``key`` now (None: it was dropped at once)."""
        check_key(key)  # before the room: a refused put changes nothing
        room = self.open_room(data.nbytes, ttl_s)
        try:
            self.segments[Tier.DRAM].write(room.offset, data)
        except BaseException:
            self.close_room(room.id)
            raise
        self.fill_room(room.id, [(key, room.offset, data.nbytes, checksum, fmt)], replicated=replicated, origin=origin)
        return self._chunks.get(key)

    def take_changes(self) -> list[Change]:
        """Every change since the last call, in order."""
        out = self._changes.copy()
        self._changes.clear()  # the books record into this same list
        return out

    # -- reading ---------------------------------------------------------------------------------------

    def locate(self, key: bytes) -> StoredChunk:
        """Pin a chunk for a reader where it is (release it with :meth:`release`), counting a read; the node promotes
        NVMe hits first (``moves.promotions``), their I/O outside its lock."""
        chunk = self._require(key)
        self.policy.pin(key)
        self.policy.touch(key)
        self.counters["gets"] += 1
        return chunk

    def locate_each(self, keys: Sequence[bytes]) -> list[StoredChunk | None]:
        """:meth:`locate` for each of ``keys``; None (and a miss counted) for one not held."""
        chunks: list[StoredChunk | None] = []
        for key in keys:
            try:
                chunks.append(self.locate(key))
            except ChunkNotFound:
                self.counters["misses"] += 1
                chunks.append(None)
        return chunks

    def pin(self, key: bytes) -> StoredChunk:
        """Pin a chunk where it is, counting no read (the node reads it for a caller, then releases it)."""
        chunk = self._require(key)
        self.policy.pin(key)
        return chunk

    def release(self, key: bytes) -> None:
        """Unpin a chunk; a key not held or not pinned (dropped as corrupt and put again meanwhile) is passed over."""
        if isinstance(key, bytes) and key in self.policy and self.policy.state(key).pins:
            self.policy.unpin(key)

    def read(self, key: bytes) -> bytes:
        """A copy of the chunk's stored bytes (for chunks on NVMe that a reader cannot reach one-sided, and tests)."""
        chunk = self._require(key)
        return bytes(read_stored(self.segments[chunk.tier], chunk.offset, chunk.stored))

    def _require(self, key: bytes) -> StoredChunk:
        chunk = self._chunks.get(key) if isinstance(key, bytes) else None
        if chunk is None:
            raise ChunkNotFound(f"chunk {short(key)} is not held by this node")
        return chunk

    # -- removing --------------------------------------------------------------------------------------

    def remove(self, key: bytes, *, corrupt: bool = False) -> None:
        chunk = self._require(key)
        if self.policy.state(key).pins and not corrupt:
            self.counters["busy"] += 1
            raise ChunkBusy(f"chunk {short(key)} is being read; remove it after the read")
        self.moves.drop(chunk, DropCause.CORRUPT if corrupt else DropCause.REMOVED)
        if corrupt:
            self.counters["corrupt"] += 1

    # -- moves between tiers (the books: ``self.moves``) ---------------------------------------------

    def move(self, key: bytes, tier: Tier) -> StoredChunk:
        """Move a chunk to ``tier`` now (an operator's or a benchmark's demotion; eviction does it by itself)."""
        chunk = self._require(key)
        self.moves.check_tier(tier)
        return chunk if chunk.tier is tier else self.moves.move_now(chunk, tier)

    def drop_corrupt(self, chunk: StoredChunk) -> None:
        """``chunk``'s bytes failed their checksum where it was read: drop it, unless it has moved since."""
        self.moves.drop_corrupt(chunk)

    @property
    def keyring(self) -> Keyring | None:
        """The keys that seal every chunk stored on NVMe (None: NVMe is not encrypted), kept by the books."""
        return self.moves.keyring

    def held(self, key: object) -> StoredChunk | None:
        """The chunk held under ``key`` (None: none, or not a key)."""
        return self._chunks.get(key) if isinstance(key, bytes) else None

    # -- the remote tier: which chunks have a copy there (pool/node/flush.py picks what to flush) ---------

    def adopt(self, chunks: Iterable[StoredChunk], corrupt: Iterable[StoredChunk] = ()) -> None:
        """Take back the NVMe chunks a node before this one left in the segment (verified: see
        :mod:`kvpool.pool.node.journal`), oldest first, as if just stored; ``corrupt``: those that failed, published as
        dropped (their tombstones say why they are gone)."""
        allocator = self.allocators[Tier.NVME]
        for chunk in chunks:
            allocator.claim(chunk.offset, chunk.stored)
            self._chunks[chunk.key] = chunk
            self.policy.add(chunk.key, Tier.NVME, allocator.size_of(chunk.offset), tenant=chunk.tenant)
            self._changes.append(Change(ChangeKind.ADDED, chunk))
        self._changes += [Change(ChangeKind.DROPPED, c, DropCause.CORRUPT) for c in corrupt]

    def mark_in_remote(self, keys: Iterable[bytes]) -> None:
        """These chunks have a copy in the remote tier now: a full tier drops them first."""
        for key in keys:
            if (chunk := self._chunks.get(key)) is not None:
                self._chunks[key] = replace(chunk, in_remote=True)
                self.policy.mark_replicated(key)

    # -- state -----------------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and key in self._chunks

    def state(self, key: bytes) -> ChunkState:
        """Where a held chunk is in its life (``ChunkNotFound`` if it is not held)."""
        self._require(key)
        if self.moves.moving(key):
            return ChunkState.MOVING
        return ChunkState.PINNED if self.policy.state(key).pins else ChunkState.STORED

    def audit(self) -> list[str]:
        """What disagrees between the allocators and what holds their extents (empty: nothing): every allocation
        belongs to exactly one chunk (stored or pinned), writer's room, or move's target (:class:`ChunkState`), and
        the eviction policy tracks every chunk in its tier, in the order its books say."""
        problems = []
        try:
            self.policy.check_invariants()
        except AssertionError as exc:
            problems.append(f"eviction policy: {exc}")
        for tier, alloc in self.allocators.items():
            try:
                alloc.check_invariants()
            except AssertionError as exc:
                problems.append(f"{tier.value} allocator: {exc}")
            owners: dict[int, ChunkState] = {}
            for offset, state in self._owners(tier):
                if offset in owners:
                    problems.append(f"{tier.value}: a {owners[offset].value} and a {state.value} share offset {offset}")
                owners[offset] = state
            try:
                held = sum(alloc.size_of(o) for o in owners)
            except ConfigError as exc:
                problems.append(f"{tier.value}: a chunk, room or move holds an extent not allocated: {exc}")
                continue
            if held != alloc.used:
                problems.append(f"{tier.value}: {alloc.used} bytes allocated, its {len(owners)} extents hold {held}")
            if self.policy.count(tier) != sum(1 for c in self._chunks.values() if c.tier is tier):
                problems.append(f"{tier.value}: the eviction policy tracks other chunks than the store holds")
        return problems

    def _owners(self, tier: Tier) -> list[tuple[int, ChunkState]]:
        """Each extent of ``tier``'s allocator that something holds, and its state."""
        owners = [
            (c.offset, ChunkState.PINNED if self.policy.state(c.key).pins else ChunkState.STORED)
            for c in self._chunks.values()
            if c.tier is tier
        ]
        if tier is Tier.DRAM:
            owners += [(o, ChunkState.ROOM) for o in self.holds.offsets()]
        return owners + [(o, ChunkState.MOVING) for o in self.moves.offsets(tier)]

    def chunks(self) -> list[StoredChunk]:
        return list(self._chunks.values())

    def tier_figures(self) -> dict[str, dict[str, float]]:
        """Per tier: bytes used and capacity, chunks, the largest free extent and fragmentation (``PoolNode.stats``)."""
        return {
            t.value: {
                "used": a.used,
                "capacity": a.capacity,
                "chunks": self.policy.count(t),
                "largest_free": a.largest_free,
                "fragmentation": a.stats().fragmentation,
            }
            for t, a in self.allocators.items()
        }

    def usage(self) -> dict[Tier, tuple[int, int]]:
        """``tier → (used, capacity)`` in bytes."""
        return {t: (a.used, a.capacity) for t, a in self.allocators.items()}
