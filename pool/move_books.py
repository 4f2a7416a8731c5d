"""The store's books of a move in steps (pool/moves.py does its I/O, without the node's lock): a move begun (the
chunk pinned, its room in the target tier given now or once its re-encoded length is known), placed, and finished
(the chunk in its new place, or left where it was, or dropped as corrupt).

:class:`MoveBooks` is mixed into :class:`~kvpool.pool.store.ChunkStore`, whose books these are; ``_Books`` names
what of the store the steps use.
"""

import logging
import threading
from dataclasses import replace
from typing import Protocol

from kvpool.core.types import DropCause, Tier
from kvpool.errors import ChunkBusy, PoolFull
from kvpool.pool.allocator import OffsetAllocator
from kvpool.pool.chunks import Change, ChangeKind, StoredChunk, short
from kvpool.pool.eviction import EvictionPolicy
from kvpool.pool.moves import Move, whole_blocks
from kvpool.pool.tiers.crypto import Keyring, sealed_name

log = logging.getLogger(__name__)


class _Books(Protocol):
    allocators: dict[Tier, OffsetAllocator]
    codecs: dict[Tier, str]
    keyring: Keyring | None
    policy: EvictionPolicy
    counters: dict[str, int]
    over_high: threading.Event
    _chunks: dict[bytes, StoredChunk]
    _moving: dict[bytes, Move]
    _changes: list[Change]

    def _require(self, key: bytes) -> StoredChunk: ...
    def _allocate(self, tier: Tier, length: int) -> int: ...
    def _drop(self, chunk: StoredChunk, cause: DropCause) -> None: ...
    def _trim_quotas(self) -> None: ...
    def busy(self, key: bytes) -> bool: ...
    def over_high_watermark(self) -> bool: ...
    def place(self, move: Move) -> None: ...


class MoveBooks:
    """Moves in steps, the books' side: :meth:`begin_move`, :meth:`place`, :meth:`finish_move`; and
    :meth:`drop_corrupt` for a chunk whose bytes failed their checksum where they were read."""

    def begin_move(self: "_Books", key: bytes, tier: Tier) -> Move:
        """Start moving a held chunk to ``tier``: it is pinned for the move, and given its room there now if its
        bytes move as they are (else after :func:`~kvpool.pool.moves.load`, by :meth:`place`).  ``ChunkBusy`` if a
        reader has it pinned or it is moving already, ``PoolFull`` if ``tier`` has no room."""
        chunk = self._require(key)
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
            try:
                self.place(move)
            finally:
                if move.failed:
                    self._moving.pop(key)
                    self.policy.unpin(key)
            if move.failed:
                raise PoolFull(move.failed)
        return move

    def place(self: "_Books", move: Move) -> None:
        """Give a begun move its room in the target tier (once its length is known); no room: ``move.failed``."""
        if move.offset is not None or move.failed or move.corrupt:
            return
        try:
            move.offset = self._allocate(move.tier, move.length)
        except PoolFull as exc:
            move.failed = str(exc)
            return
        move.span = move.chunk.stored
        if move.key in self.policy and self.policy.state(move.key) is move.pin:  # not dropped: its room is its own
            rooms = (
                self.allocators[move.chunk.tier].size_of(move.chunk.offset),
                self.allocators[move.tier].size_of(move.offset),
            )
            move.span = whole_blocks(move.chunk.stored, *rooms)

    def finish_move(self: "_Books", move: Move) -> StoredChunk | None:
        """End a move: the chunk in its new place, or where it was if the move failed, a reader pinned it
        meanwhile, or it was dropped or replaced; dropped if its bytes were found corrupt.  What the chunk is now
        (None: not held)."""
        begun = self._moving.pop(move.key)
        assert begun is move
        current = self._chunks.get(move.key)
        # the same chunk, still pinned by this move: not dropped (and maybe put again, even at the same offset)
        same = current is not None and move.key in self.policy and self.policy.state(move.key) is move.pin
        if same:
            self.policy.unpin(move.key)
        done = same and not move.failed and not move.corrupt and not self.policy.state(move.key).pins
        if not done and move.offset is not None:
            self.allocators[move.tier].free(move.offset)
        if same and move.corrupt:
            log.warning("chunk %s fails its checksum in %s: dropped", short(move.key), move.chunk.tier.value)
            assert current is not None
            self._drop(current, DropCause.CORRUPT)
            self.counters["corrupt"] += 1
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
        self._chunks[move.key] = moved
        self.policy.move(move.key, move.tier, self.allocators[move.tier].size_of(move.offset))
        self.counters["migrations" if move.tier is Tier.NVME else "promotions"] += 1
        self._changes.append(Change(ChangeKind.MOVED, moved))
        if move.tier is Tier.DRAM and self.over_high_watermark():  # promoted past the high watermark: demote others
            self.over_high.set()
        self._trim_quotas()
        return self._chunks.get(move.key)

    def drop_corrupt(self: "_Books", chunk: StoredChunk) -> None:
        """``chunk``'s bytes failed their checksum where it was read: drop it, unless it has moved since."""
        current = self._chunks.get(chunk.key)
        if current is not None and (current.tier, current.offset) == (chunk.tier, chunk.offset):
            log.warning("chunk %s fails its checksum in %s: dropped", short(chunk.key), chunk.tier.value)
            self._drop(current, DropCause.CORRUPT)
            self.counters["corrupt"] += 1
