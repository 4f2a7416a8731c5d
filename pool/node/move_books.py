"""Where a store's chunks go between its tiers: moves in steps (pool/node/moves.py does their I/O, without the node's lock),
the room a full tier makes (its least recently used chunks moved down, or dropped), and tenants kept to their quotas.

A move is begun (the chunk pinned, its room in the target tier given now or once its re-encoded length is known),
placed, and finished (the chunk in its new place, or left where it was, or dropped as corrupt).
:meth:`~MoveBooks.promotions`, :meth:`~MoveBooks.moves_to` and :meth:`~MoveBooks.demotions` choose and begin moves;
:meth:`~MoveBooks.run` drives their steps — the store inline, the node with its lock.

Invariant: a chunk has at most one move in flight, which pins it; the move's room in its target tier is a live
allocation owned by the move until it finishes (the store's ``audit`` counts :meth:`~MoveBooks.offsets`).
"""

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor

from msgspec.structs import replace

from kvpool.core.types import DropCause, Tier
from kvpool.errors import ChunkBusy, ConfigError, CorruptChunk, PoolFull
from kvpool.pool.chunks import Change, ChangeKind, StoredChunk, short
from kvpool.pool.config import Watermarks
from kvpool.pool.node.allocator import OffsetAllocator
from kvpool.pool.node.eviction import EvictionPolicy
from kvpool.pool.node.moves import Move, Segments, load, whole_blocks, write
from kvpool.pool.tiers.crypto import Keyring, sealed_name

log = logging.getLogger(__name__)


class MoveBooks:
    """Owned by a :class:`~kvpool.pool.node.store.ChunkStore`, which hands it what it keeps in step: the segments and their
    allocators, the eviction policy, the store's chunks by key, the changes it publishes and its counters; the tiers'
    codecs, the keys that seal NVMe, the tenants' quotas, the watermarks, and the flag a DRAM above its high
    watermark raises."""

    def __init__(
        self,
        segments: Segments,
        allocators: Mapping[Tier, OffsetAllocator],
        policy: EvictionPolicy,
        chunks: dict[bytes, StoredChunk],
        changes: list[Change],
        counters: dict[str, int],
        *,
        codecs: Mapping[Tier, str],
        keyring: Keyring | None,
        quotas: Mapping[str, tuple[int, int]],
        watermarks: Watermarks,
        over_high: threading.Event,
    ) -> None:
        self.segments, self.allocators, self.policy = segments, allocators, policy
        self.chunks, self.changes, self.counters = chunks, changes, counters
        self.codecs, self.keyring, self.quotas, self.watermarks = codecs, keyring, quotas, watermarks
        self.over_high = over_high
        self._moving: dict[bytes, Move] = {}  #: moves begun and not finished; each owns its target room

    # -- room: allocation with eviction, drops, quotas, the watermark ---------------------------------

    def allocate(self, tier: Tier, length: int) -> int:
        """``length`` bytes of ``tier``, made room for by moving least recently used chunks down or dropping them."""
        alloc = self.allocators[tier]
        if length > alloc.capacity:
            raise PoolFull(
                f"a chunk of {length / 2**20:.1f} MiB is larger than this node's {tier.value} segment "
                f"({alloc.capacity / 2**20:.1f} MiB); use smaller chunks or a larger segment"
            )
        while not alloc.can_allocate(length):
            victim = self._next_victim(tier)
            if victim is None:
                pinned = sum(1 for k in self.chunks if self.policy.state(k).pins)
                raise PoolFull(
                    f"{tier.value} segment full: {alloc.used / 2**20:.1f} of {alloc.capacity / 2**20:.1f} MiB used, "
                    f"no room for {length / 2**20:.1f} MiB and nothing left to evict ({pinned} chunks pinned by readers)"
                )
            self._evict(victim, tier)
        return alloc.allocate(length)

    def _next_victim(self, tier: Tier) -> StoredChunk | None:
        order = (
            self.policy.lru(tier) if tier is Tier.DRAM and Tier.NVME in self.segments else self.policy.drop_order(tier)
        )
        key = next(order, None)
        return self.chunks[key] if key is not None else None

    def _evict(self, chunk: StoredChunk, tier: Tier) -> None:
        """Make room in ``tier``: DRAM chunks go down to NVMe when there is one; otherwise they are dropped."""
        if tier is Tier.DRAM and Tier.NVME in self.segments:
            try:
                self.move_now(chunk, Tier.NVME)
                return
            except CorruptChunk:
                return  # dropped: that made the room
            except PoolFull as exc:
                log.info("NVMe cannot take %s (%s); dropping it from DRAM", short(chunk.key), exc)
        self.drop(chunk, DropCause.EVICTED)
        self.counters["drops"] += 1

    def drop(self, chunk: StoredChunk, cause: DropCause) -> None:
        """``chunk`` leaves the node: its room given back, the change recorded."""
        self.allocators[chunk.tier].free(chunk.offset)
        self.policy.remove(chunk.key)
        del self.chunks[chunk.key]
        self.changes.append(Change(ChangeKind.DROPPED, chunk, cause))

    def drop_corrupt(self, chunk: StoredChunk) -> None:
        """``chunk``'s bytes failed their checksum where it was read: drop it, unless it has moved since."""
        current = self.chunks.get(chunk.key)
        if current is not None and (current.tier, current.offset) == (chunk.tier, chunk.offset):
            log.warning("chunk %s fails its checksum in %s: dropped", short(chunk.key), chunk.tier.value)
            self.drop(current, DropCause.CORRUPT)
            self.counters["corrupt"] += 1

    def trim_quotas(self) -> None:
        """Tenants over their quota lose their own LRU chunks: dropped from NVMe (or from DRAM when there is no NVMe
        below it); over it in DRAM with NVMe below, they move down with the next :meth:`demotions`."""
        for key in self.policy.over_quota(self.quotas, Tier.NVME if Tier.NVME in self.segments else Tier.DRAM):
            self.drop(self.chunks[key], DropCause.EVICTED)
            self.counters["quota_drops"] += 1

    def over_high_watermark(self) -> bool:
        """Whether DRAM is above its high watermark (with an NVMe tier below it to demote to)."""
        alloc = self.allocators[Tier.DRAM]
        return Tier.NVME in self.segments and alloc.used > self.watermarks.high * alloc.capacity

    def check_tier(self, tier: Tier) -> None:
        """``ConfigError`` unless the store has a segment of ``tier``."""
        if tier not in self.segments:
            raise ConfigError(
                f"this node has no {tier.value} tier"
                if isinstance(tier, Tier)
                else f"tier must be a Tier, got {tier!r:.40}"
            )

    # -- a move in steps -------------------------------------------------------------------------------

    def busy(self, key: bytes) -> bool:
        """Whether a held chunk is pinned by a reader or being moved."""
        return bool(self.policy.state(key).pins) or key in self._moving

    def begin(self, chunk: StoredChunk, tier: Tier) -> Move:
        """Start moving a held chunk to ``tier``: it is pinned for the move, and given its room there now if its
        bytes move as they are (else after :func:`~kvpool.pool.node.moves.load`, by :meth:`place`).  ``ChunkBusy`` if a
        reader has it pinned or it is moving already, ``PoolFull`` if ``tier`` has no room."""
        key = chunk.key
        if self.busy(key):
            self.counters["busy"] += 1
            raise ChunkBusy(f"chunk {short(key)} is being read or moved; move it after that")
        codec = self.codecs.get(tier, "raw") if chunk.fmt is not None else "raw"
        sealed = tier is Tier.NVME and self.keyring is not None
        move = Move(chunk, tier, sealed_name(codec) if sealed else codec, keys=self.keyring)
        self.policy.pin(key)  # not a victim of the room we make for it, nor of anyone else's
        move.pin = self.policy.state(key)
        self._moving[key] = move
        if not move.recoding:
            self.place(move)
            if move.failed:  # called off: nothing was given to it
                self._moving.pop(key)
                self.policy.unpin(key)
                raise PoolFull(move.failed)
        return move

    def place(self, move: Move) -> None:
        """Give a begun move its room in the target tier (once its length is known); no room: ``move.failed``."""
        if move.offset is not None or move.failed or move.corrupt:
            return
        try:
            move.offset = self.allocate(move.tier, move.length)
        except PoolFull as exc:
            move.failed = str(exc)
            return
        move.span = move.chunk.stored
        if self._pinned_by(move):  # not dropped: its room is its own
            rooms = (
                self.allocators[move.chunk.tier].size_of(move.chunk.offset),
                self.allocators[move.tier].size_of(move.offset),
            )
            move.span = whole_blocks(move.chunk.stored, *rooms)

    def finish(self, move: Move) -> StoredChunk | None:
        """End a move: the chunk in its new place, or where it was if the move failed, a reader pinned it
        meanwhile, or it was dropped or replaced; dropped if its bytes were found corrupt.  What the chunk is now
        (None: not held)."""
        begun = self._moving.pop(move.key)
        assert begun is move
        current = self.chunks.get(move.key)
        # the same chunk, still pinned by this move: not dropped (and maybe put again, even at the same offset)
        same = current is not None and self._pinned_by(move)
        if same:
            self.policy.unpin(move.key)
        done = same and not move.failed and not move.corrupt and not self.policy.state(move.key).pins
        if not done and move.offset is not None:
            self.allocators[move.tier].free(move.offset)
        if same and move.corrupt:
            self.drop_corrupt(move.chunk)  # where the move found it: a moving chunk moves nowhere else
            return None
        if not done or current is None or move.offset is None:
            return current
        self.allocators[current.tier].free(current.offset)
        moved = replace(current, tier=move.tier, offset=move.offset)
        if move.recoded is not None:
            r = move.recoded
            moved = replace(moved, stored=len(r.data), checksum=r.checksum, codec=r.codec, fmt=r.fmt)
            if r.codec != current.codec:
                self.counters["encoded" if r.codec != "raw" else "decoded"] += 1
        self.chunks[move.key] = moved
        self.policy.move(move.key, move.tier, self.allocators[move.tier].size_of(move.offset))
        self.counters["migrations" if move.tier is Tier.NVME else "promotions"] += 1
        self.changes.append(Change(ChangeKind.MOVED, moved))
        if move.tier is Tier.DRAM and self.over_high_watermark():  # promoted past the high watermark: demote others
            self.over_high.set()
        self.trim_quotas()
        return self.chunks.get(move.key)

    def _pinned_by(self, move: Move) -> bool:
        """Whether the chunk under ``move``'s key still holds the pin the move took (it was not dropped meanwhile)."""
        return move.key in self.policy and self.policy.state(move.key) is move.pin

    def moving(self, key: bytes) -> bool:
        """Whether a move of ``key`` has begun and not finished."""
        return key in self._moving

    def offsets(self, tier: Tier) -> list[int]:
        """Where the rooms given to moves to ``tier`` start (for the store's audit)."""
        return [m.offset for m in self._moving.values() if m.tier is tier and m.offset is not None]

    def move_now(self, chunk: StoredChunk, tier: Tier) -> StoredChunk:
        """Re-store ``chunk`` in ``tier`` now, with that tier's codec; ``CorruptChunk`` (and the chunk dropped) if it
        has to be re-encoded and its bytes fail their checksum, ``PoolFull`` if the tier has no room for it."""
        move = self.begin(chunk, tier)
        [moved] = self.run([move])
        if move.corrupt or moved is None:
            raise CorruptChunk(f"chunk {short(chunk.key)} was corrupt in {chunk.tier.value} and has been dropped")
        if move.failed:
            raise PoolFull(move.failed)
        return moved

    # -- which moves to make: a reader's hits, an operator's batch, the watermark --------------------------

    def promotions(self, keys: Iterable[bytes]) -> list[Move]:
        """Begun moves to DRAM of the held chunks among ``keys`` that are on NVMe and neither pinned nor moving (a
        reader's hits, promoted before the reader pins them); one DRAM has no room for stays where it is."""
        out: list[Move] = []
        for key in keys:
            chunk = self.chunks.get(key) if isinstance(key, bytes) else None
            if chunk is None or chunk.tier is not Tier.NVME or self.busy(key):
                continue
            try:
                out.append(self.begin(chunk, Tier.DRAM))
            except PoolFull as exc:
                log.info("not promoting %s to DRAM: %s", short(key), exc)
                break
        return out

    def moves_to(self, keys: Iterable[bytes], tier: Tier) -> tuple[list[Move], list[bytes], str]:
        """Begun moves to ``tier`` of the held chunks among ``keys`` that are elsewhere; the keys left as they are
        because a reader has them pinned; and why the rest were not begun ("": they were) — ``tier`` is full."""
        self.check_tier(tier)
        moves: list[Move] = []
        busy: list[bytes] = []
        for key in keys:
            chunk = self.chunks.get(key) if isinstance(key, bytes) else None
            if chunk is None or chunk.tier is tier:
                continue
            try:
                moves.append(self.begin(chunk, tier))
            except ChunkBusy:
                busy.append(key)
            except PoolFull as exc:
                return moves, busy, str(exc)
        return moves, busy, ""

    def demotions(self, max_bytes: int | None = None, need: int = 0) -> list[Move]:
        """DRAM above its high watermark, or without a free extent of ``need`` bytes: begun moves of LRU chunks to
        NVMe that bring it to the low watermark, or free ``need`` bytes (at most ``max_bytes`` of them), for the
        caller to run."""
        alloc = self.allocators[Tier.DRAM]
        #: what DRAM's free extents would be after the moves planned so far (only while room for ``need`` is wanted)
        after = alloc.copy() if need > alloc.largest_free else None
        #: first: tenants over their DRAM quota move their own (with no NVMe below, trim_quotas drops them instead)
        quota = self.policy.over_quota(self.quotas, Tier.DRAM) if Tier.NVME in self.segments else []
        if not self.over_high_watermark() and after is None and not quota:
            return []
        excess, planned = alloc.used - self.watermarks.low * alloc.capacity, 0
        out: list[Move] = []
        for key in quota:
            try:
                out.append(self.begin(self.chunks[key], Tier.NVME))
            except PoolFull as exc:
                log.warning("a tenant is over its DRAM quota but NVMe cannot take more: %s", exc)
                return out
            planned += alloc.size_of(out[-1].chunk.offset)
            if after is not None:
                after.free(out[-1].chunk.offset)
        for key in self.policy.lru(Tier.DRAM):  # read as it goes: begin pins (takes out) only the key it is given
            room_made = after is None or after.largest_free >= need
            if (planned >= excess and room_made) or (max_bytes is not None and out and planned >= max_bytes):
                break
            try:
                move = self.begin(self.chunks[key], Tier.NVME)
            except PoolFull as exc:
                log.warning("DRAM needs room but NVMe cannot take more: %s", exc)
                break
            out.append(move)
            planned += alloc.size_of(move.chunk.offset)
            if after is not None:
                after.free(move.chunk.offset)
        return out

    def maintain(self) -> None:
        """DRAM above its high watermark: migrate LRU chunks to NVMe until the low watermark, now."""
        self.run(self.demotions())

    def run(
        self,
        moves: Sequence[Move],
        lock: contextlib.AbstractContextManager[object] | None = None,
        executor: Executor | None = None,
    ) -> list[StoredChunk | None]:
        """Do begun moves: their I/O without ``lock`` (in ``executor``'s threads, if given), the books with it.
        What each chunk is now (None: dropped as corrupt)."""
        held = lock if lock is not None else contextlib.nullcontext()
        _each(load, moves, self.segments, executor)
        with held:
            for m in moves:
                self.place(m)
        _each(write, moves, self.segments, executor)
        with held:
            return [self.finish(m) for m in moves]


def _each(
    step: Callable[[Move, Segments], None], moves: Sequence[Move], segments: Segments, executor: Executor | None
) -> None:
    if executor is None or len(moves) < 2:
        for m in moves:
            step(m, segments)
    else:
        list(executor.map(step, moves, [segments] * len(moves)))
