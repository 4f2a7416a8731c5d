"""A chunk's move between tiers, in steps, so that its I/O runs without the node's lock.

A move is begun, given its room (once its re-encoded length is known) and finished by the store's
:class:`~kvpool.pool.node.move_books.MoveBooks`, which keeps the books; its bytes are read, re-encoded and written by
:func:`load` and :func:`write`, which touch nothing but the segments and the move itself, so a ``PoolNode`` runs them
for many chunks at once in threads while its other calls go on.

While a chunk moves it stays readable where it was: the move holds a pin (it is no eviction victim, and a plain
remove is ``ChunkBusy``), and the room it moves to is owned by the move until it finishes.  The move is called off
at its finish (the target's room given back, the chunk where it was) if a reader pinned the chunk meanwhile or it
was dropped.
"""

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from kvpool.core.types import Tier
from kvpool.errors import KvPoolError
from kvpool.pool.chunks import Recoded, StoredChunk, checksum, short
from kvpool.pool.segment import ALIGN, DramSegment, NvmeSegment
from kvpool.pool.tiers.codecs import Buffer, transcode
from kvpool.pool.tiers.crypto import Keyring, UndecryptableChunk, seal, split, unseal

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
