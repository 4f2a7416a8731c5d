"""A chunk's move between tiers, in steps, so that its I/O runs without the node's lock.

A move is begun, finished and (for a re-encoded chunk) given its room by the :class:`~kvpool.pool.store.ChunkStore`,
which keeps the books; its bytes are read, re-encoded and written by :func:`load` and :func:`write`, which touch
nothing but the segments and the move itself, so a ``PoolNode`` runs them for many chunks at once in threads while
its other calls go on.  :func:`promotions`, :func:`moves_to` and :func:`demotions` choose and begin moves;
:func:`run_moves` drives their steps — ``ChunkStore`` inline, the node with its lock.

While a chunk moves it stays readable where it was: the move holds a pin (it is no eviction victim, and a plain
remove is ``ChunkBusy``), and the room it moves to is owned by the move until it finishes.  The move is called off
at its finish (the target's room given back, the chunk where it was) if a reader pinned the chunk meanwhile or it
was dropped.
"""

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.core.types import Tier
from kvpool.errors import ChunkBusy, KvPoolError, PoolFull
from kvpool.pool.chunks import Recoded, StoredChunk, checksum, short
from kvpool.pool.segment import ALIGN, DramSegment, NvmeSegment
from kvpool.pool.tiers.codecs import Buffer, transcode
from kvpool.pool.tiers.crypto import Keyring, UndecryptableChunk, seal, split, unseal

if TYPE_CHECKING:
    from kvpool.pool.store import ChunkStore

log = logging.getLogger(__name__)
Segments = Mapping[Tier, DramSegment | NvmeSegment]


@dataclass
class Move:
    chunk: StoredChunk  #: the chunk as it was when the move began
    tier: Tier  #: where it goes
    codec: str  #: the codec it is stored with there
    offset: int | None = None  #: its room in ``tier`` (None: not given yet)
    span: int = 0  #: bytes a raw move transfers: the chunk's, or rounded up to whole blocks when both rooms hold them
    recoded: Recoded | None = None  #: its bytes under ``codec``, when that is another codec than the chunk's
    corrupt: bool = False  #: its stored bytes failed their checksum: the chunk is dropped at the finish
    failed: str = ""  #: why it could not be done (no room, an I/O error): the chunk stays where it was
    pin: object = None  #: the eviction policy's record of the chunk the move pinned (a dropped chunk's is gone)
    keys: Keyring | None = None  #: the store's keys: seal for a sealed ``codec``, open a sealed chunk

    @property
    def key(self) -> bytes:
        return self.chunk.key

    @property
    def length(self) -> int:
        """Bytes the chunk takes in ``tier``."""
        return self.chunk.stored if self.recoded is None else len(self.recoded.data)

    @property
    def recoding(self) -> bool:
        return self.codec != self.chunk.codec


def read_stored(segment: DramSegment | NvmeSegment, offset: int, length: int) -> Buffer:
    """A copy of ``length`` stored bytes at ``offset``."""
    if isinstance(segment, DramSegment):
        return bytes(segment.view(offset, length))
    return segment.read(offset, length)


def recode(
    chunk: StoredChunk, stored: Buffer, codec: str, keys: Keyring | None = None, source_keys: Keyring | None = None
) -> Recoded | None:
    """``chunk``'s stored bytes under ``codec``; None if they fail their checksum, or are sealed and cannot be opened
    (with ``source_keys``, default ``keys``: the key is gone, or the bytes were altered) or sealed.  A chunk ``codec``
    cannot encode (NaN in a quantized codec's input; plain bytes) keeps the codec it has below the seal: a ``codec``
    ending in ``+aes256gcm`` (pool/tiers/crypto.py) seals whatever the chunk is, with ``keys``."""
    if checksum(stored) != chunk.checksum:
        return None
    target, sealed = split(codec)
    try:
        plain, source = unseal(stored, chunk.codec, chunk.key, keys if source_keys is None else source_keys)
    except UndecryptableChunk as exc:
        log.warning("chunk %s cannot be opened by this node: %s", short(chunk.key), exc)
        return None
    try:
        data, fmt = transcode(plain, source, target, chunk.fmt)
    except KvPoolError as exc:  # UnencodableTensor (NaN/inf, plain bytes), UndecodableChunk
        if not sealed:
            log.info("chunk %s stays %s: %s", short(chunk.key), source, exc)
        data, fmt, target = plain, chunk.fmt, source
    if sealed:
        try:
            data, target = seal(data, chunk.key, target, keys, chunk.tenant)
        except KvPoolError as exc:  # never stored unsealed in a tier that seals
            log.warning("chunk %s cannot be sealed: %s", short(chunk.key), exc)
            return None
    if data is stored:
        return Recoded(stored, chunk.codec, chunk.fmt, chunk.checksum)
    return Recoded(data, target, fmt, checksum(data))


def load(move: Move, segments: Segments) -> None:
    """No lock: read and re-encode the bytes of a move to a tier with another codec (a raw move reads nothing
    here: :func:`write` copies them)."""
    if not move.recoding or move.failed:
        return
    try:
        stored = read_stored(segments[move.chunk.tier], move.chunk.offset, move.chunk.stored)
    except OSError as exc:
        move.failed = f"reading {short(move.key)}: {exc}"
        return
    move.recoded = recode(move.chunk, stored, move.codec, move.keys)
    move.corrupt = move.recoded is None


def write(move: Move, segments: Segments) -> None:
    """No lock: put the chunk's bytes in its new room: the re-encoded ones, or the stored ones copied across —
    straight between the mapped DRAM range and the NVMe file, in whole blocks where both rooms have them."""
    if move.offset is None or move.failed or move.corrupt:
        return
    src, dst = segments[move.chunk.tier], segments[move.tier]
    try:
        if move.recoded is not None:
            dst.write(move.offset, move.recoded.data)
        elif isinstance(src, DramSegment):
            with src.view(move.chunk.offset, move.span) as view:
                dst.write(move.offset, view)
        elif isinstance(dst, DramSegment):
            with dst.view(move.offset, move.span) as view:
                src.read_into(move.chunk.offset, view)
        else:
            dst.write(move.offset, src.read(move.chunk.offset, move.chunk.stored))
    except OSError as exc:
        move.failed = f"writing {short(move.key)} to {move.tier.value}: {exc}"


def whole_blocks(length: int, *rooms: int) -> int:
    """``length`` rounded up to whole I/O blocks if every room (allocation) holds that much, else ``length``."""
    padded = -(-length // ALIGN) * ALIGN
    return padded if all(padded <= r for r in rooms) else length


# -- which moves to make: a reader's hits, an operator's batch, the watermark ------------------------------


def promotions(store: "ChunkStore", keys: Iterable[bytes]) -> list[Move]:
    """Begun moves to DRAM of the held chunks among ``keys`` that are on NVMe and neither pinned nor moving (a
    reader's hits, promoted before the reader pins them); one DRAM has no room for stays where it is."""
    out: list[Move] = []
    for key in keys:
        chunk = store.held(key)
        if chunk is None or chunk.tier is not Tier.NVME or store.busy(key):
            continue
        try:
            out.append(store.begin_move(key, Tier.DRAM))
        except PoolFull as exc:
            log.info("not promoting %s to DRAM: %s", short(key), exc)
            break
    return out


def moves_to(store: "ChunkStore", keys: Iterable[bytes], tier: Tier) -> tuple[list[Move], list[bytes], str]:
    """Begun moves to ``tier`` of the held chunks among ``keys`` that are elsewhere; the keys left as they are because
    a reader has them pinned; and why the rest were not begun ("": they were) — ``tier`` is full."""
    store.check_tier(tier)
    moves: list[Move] = []
    busy: list[bytes] = []
    for key in keys:
        chunk = store.held(key)
        if chunk is None or chunk.tier is tier:
            continue
        try:
            moves.append(store.begin_move(key, tier))
        except ChunkBusy:
            busy.append(key)
        except PoolFull as exc:
            return moves, busy, str(exc)
    return moves, busy, ""


def demotions(store: "ChunkStore", max_bytes: int | None = None, need: int = 0) -> list[Move]:
    """DRAM above its high watermark, or without a free extent of ``need`` bytes: begun moves of LRU chunks to NVMe
    that bring it to the low watermark, or free ``need`` bytes (at most ``max_bytes`` of them), for the caller to
    run."""
    alloc = store.allocators[Tier.DRAM]
    #: what DRAM's free extents would be after the moves planned so far (only while room for ``need`` is wanted)
    after = alloc.copy() if need > alloc.largest_free else None
    #: first: tenants over their DRAM quota move their own (with no NVMe below, the store drops them instead)
    quota = store.policy.over_quota(store.quotas, Tier.DRAM) if Tier.NVME in store.segments else []
    if not store.over_high_watermark() and after is None and not quota:
        return []
    excess, planned = alloc.used - store.watermarks.low * alloc.capacity, 0
    out: list[Move] = []
    for key in quota:
        try:
            out.append(store.begin_move(key, Tier.NVME))
        except PoolFull as exc:
            log.warning("a tenant is over its DRAM quota but NVMe cannot take more: %s", exc)
            return out
        planned += alloc.size_of(out[-1].chunk.offset)
        if after is not None:
            after.free(out[-1].chunk.offset)
    for key in store.policy.lru(Tier.DRAM):  # read as it goes: begin_move pins (takes out) only the key it is given
        room_made = after is None or after.largest_free >= need
        if (planned >= excess and room_made) or (max_bytes is not None and out and planned >= max_bytes):
            break
        try:
            move = store.begin_move(key, Tier.NVME)
        except PoolFull as exc:
            log.warning("DRAM needs room but NVMe cannot take more: %s", exc)
            break
        out.append(move)
        planned += alloc.size_of(move.chunk.offset)
        if after is not None:
            after.free(move.chunk.offset)
    return out


# -- doing them ------------------------------------------------------------------------------------------------


def _each(step: Callable[[Move, Segments], None], moves: Sequence[Move], segments: Segments,
          executor: Executor | None) -> None:  # fmt: skip
    if executor is None or len(moves) < 2:
        for m in moves:
            step(m, segments)
    else:
        list(executor.map(step, moves, [segments] * len(moves)))


def run_moves(
    store: "ChunkStore", moves: Sequence[Move], lock: contextlib.AbstractContextManager[object] | None = None,
    executor: Executor | None = None,
) -> list[StoredChunk | None]:  # fmt: skip
    """Do begun moves: their I/O without ``lock`` (in ``executor``'s threads, if given), the store's books with it.
    What each chunk is now (None: dropped as corrupt)."""
    held = lock if lock is not None else contextlib.nullcontext()
    _each(load, moves, store.segments, executor)
    with held:
        for m in moves:
            store.place(m)
    _each(write, moves, store.segments, executor)
    with held:
        return [store.finish_move(m) for m in moves]
