"""What a node knows of each chunk it holds, and the records its store hands out: where a chunk is stored and
under which codec, whose it is, a change to publish.  (A writer's room and the other records of the node calls are in
:mod:`kvpool.pool.protocol`.)"""

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated

import crc32c
import msgspec
from msgspec import Meta

from kvpool.core.config import Config
from kvpool.core.types import DropCause, Tier
from kvpool.metadata.namespace import FINGERPRINT_HEX
from kvpool.pool.tenants import TenantName
from kvpool.pool.tiers.codecs import Buffer, TensorFormat

SEGMENT_NAMES = {Tier.DRAM: "dram0", Tier.NVME: "nvme0"}


def checksum(data: Buffer) -> int:
    """The checksum of stored bytes, as placements record it (crc32c)."""
    return int(crc32c.crc32c(data))


def checksum_of(pieces: Sequence[Buffer]) -> int:
    """:func:`checksum` of the bytes of ``pieces`` taken in order, as if they were one buffer."""
    value = 0
    for piece in pieces:
        value = crc32c.crc32c(piece, value)
    return int(value)


COPY_BLOCK = 256 << 10  #: bytes :func:`copy_checked` copies before it checksums them (they are still in cache then)


def gather_checked(pieces: Sequence[memoryview], dest: memoryview) -> int:
    """Copy ``pieces`` (in order) into ``dest`` and return the checksum of what landed there, as :func:`copy_checked`
    does: one pass over memory."""
    value, at = 0, 0
    for piece in pieces:
        for start in range(0, piece.nbytes, COPY_BLOCK):
            n = min(COPY_BLOCK, piece.nbytes - start)
            block = dest[at : at + n]
            block[:] = piece[start : start + n]
            value = crc32c.crc32c(block, value)
            at += n
    return int(value)


def copy_checked(src: memoryview, pieces: list[memoryview]) -> int:
    """Copy ``src`` into ``pieces`` (its bytes in order, piece after piece) and return the checksum of what landed
    there.  Each block is checksummed right after it is copied, from the cache: one pass over memory, not two."""
    value, at = 0, 0
    for piece in pieces:
        for start in range(0, piece.nbytes, COPY_BLOCK):
            block = piece[start : start + COPY_BLOCK]
            block[:] = src[at : at + block.nbytes]
            value = crc32c.crc32c(block, value)
            at += block.nbytes
    return int(value)


#: a cache identity's fingerprint, as puts carry it ("" for none)
Fingerprint = Annotated[
    str,
    Meta(
        pattern=f"^([0-9a-f]{{{FINGERPRINT_HEX}}})?\\Z",
        description=f"a cache identity's fingerprint ({FINGERPRINT_HEX} lower-case hex digits: what "
        "PoolClient.register_identity returns, kvpool.metadata.identities.fingerprint computes) or '' for none",
    ),
]


class Origin(Config, frozen=True):
    """Whose chunks a put writes, carried with them from the writer to their placements: the tenant charged for them
    (quotas, metrics: pool/tenants.py) and the fingerprint of the cache identity their keys were made under (chunk
    events report it, so a router keeps to the caches it serves).  "" for either: the writer gave none.  Checked
    wherever it is made, a Ray call's unpickled argument included."""

    tenant: TenantName = ""
    identity: Fingerprint = ""


@lru_cache(maxsize=4096)
def shared_origin(origin: Origin) -> Origin:
    """One object (and so one pair of strings) for every chunk of an origin: the first equal one seen."""
    return origin


class StoredChunk(msgspec.Struct, frozen=True):
    """One chunk a node holds: where it is stored and how, and whose it is.  Crosses the wire in ``prepare_load``'s
    reply (:class:`~kvpool.pool.protocol.Loaded`)."""

    key: bytes
    tier: Tier
    offset: int
    stored: int  #: bytes stored, after the codec: what a transfer moves
    size: int  #: bytes of the chunk itself, what a reader gets (equals ``stored`` under the raw codec)
    checksum: int  #: of the stored bytes
    codec: str = "raw"  #: how the stored bytes encode the chunk ("raw": they are the chunk)
    fmt: TensorFormat | None = None  #: the chunk's tensor format, if it was put as a tensor
    in_remote: bool = False  #: a copy is in the remote tier (flushed), so dropping this one loses nothing
    origin: Origin = Origin()  #: who put it: its tenant (quotas, metrics) and cache identity (chunk events)

    @property
    def tenant(self) -> str:
        return self.origin.tenant

    @property
    def segment(self) -> str:
        return SEGMENT_NAMES[self.tier]


@dataclass(frozen=True)
class Recoded:
    """A chunk's bytes under some codec (see :func:`kvpool.pool.node.moves.recode`)."""

    data: Buffer
    codec: str
    fmt: TensorFormat | None
    checksum: int


class ChunkState(enum.Enum):
    """Where a chunk is in its life on one node, in the words ``audit()`` reports (after Mooncake's ``ReplicaStatus``).
    Each state owns one extent of a tier's allocator: that is what the audit checks."""

    ROOM = "room"  #: DRAM given to a writer (``prepare_store``), its keys unknown to the node until ``complete_store``
    STORED = "stored"  #: visible: its placement is published, it may be moved, dropped or read
    PINNED = "pinned"  #: stored, and a reader holds it (``prepare_load`` to ``complete_load``): never moved or dropped
    MOVING = "moving"  #: stored, with a copy under way to another tier, whose extent there the move holds


class ChangeKind(enum.Enum):
    ADDED = "added"
    MOVED = "moved"
    DROPPED = "dropped"


@dataclass(frozen=True)
class Change:
    kind: ChangeKind
    chunk: StoredChunk
    cause: DropCause | None = None  #: why a DROPPED chunk was let go


def short(key: bytes) -> str:
    return key.hex()[:16] if isinstance(key, bytes) else f"{key!r:.16}"
