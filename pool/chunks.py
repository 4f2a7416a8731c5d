"""What a node knows of each chunk it holds, and the records its store hands out: where a chunk is stored and
under which codec, whose it is, a reservation of DRAM room for a key or a room for a batch, a change to publish."""

import enum
import re
import sys
from dataclasses import dataclass
from itertools import pairwise

import crc32c

from kvpool.core.keys import check_key
from kvpool.core.types import DropCause, Tier
from kvpool.errors import ConfigError
from kvpool.metadata.namespace import FINGERPRINT_HEX
from kvpool.pool.tenants import check_tenant
from kvpool.pool.tiers.codecs import Buffer, TensorFormat

SEGMENT_NAMES = {Tier.DRAM: "dram0", Tier.NVME: "nvme0"}
_FINGERPRINT = re.compile(f"[0-9a-f]{{{FINGERPRINT_HEX}}}", re.ASCII)


def checksum(data: Buffer) -> int:
    """The checksum of stored bytes, as placements record it (crc32c)."""
    return int(crc32c.crc32c(data))


def check_fingerprint(identity: object) -> str:
    """``identity`` if it is a cache identity's fingerprint (or "" for none); ``ConfigError`` saying what to pass."""
    if identity != "" and not (isinstance(identity, str) and _FINGERPRINT.fullmatch(identity)):
        raise ConfigError(
            f"identity must be a cache identity's fingerprint ({FINGERPRINT_HEX} lower-case hex digits: what "
            "PoolClient.register_identity returns, kvpool.metadata.identities.fingerprint computes) or '' for none, "
            f"got {identity!r:.40}"
        )
    return str(identity)


@dataclass(frozen=True)
class Origin:
    """Whose chunks a put writes, carried with them from the writer to their placements: the tenant charged for them
    (quotas, metrics: pool/tenants.py) and the fingerprint of the cache identity their keys were made under (chunk
    events report it, so a router keeps to the caches it serves).  "" for either: the writer gave none."""

    tenant: str = ""
    identity: str = ""

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        check_fingerprint(self.identity)


def check_origin(origin: object) -> Origin:
    """``origin`` checked again (a Ray call's argument arrives unpickled, ``__post_init__`` not run), its strings
    shared by every chunk that names them; ``ConfigError`` if it is not an :class:`Origin`."""
    if not isinstance(origin, Origin):
        raise ConfigError(f"origin must be an Origin(tenant, identity), got {type(origin).__name__} {origin!r:.40}")
    return Origin(sys.intern(check_tenant(origin.tenant)), sys.intern(check_fingerprint(origin.identity)))


@dataclass(frozen=True)
class StoredChunk:
    key: bytes
    tier: Tier
    offset: int
    stored: int  #: bytes stored, after the codec: what a transfer moves
    size: int  #: bytes of the chunk itself, what a reader gets (equals ``stored`` under the raw codec)
    checksum: int  #: of the stored bytes
    codec: str = "raw"  #: how the stored bytes encode the chunk ("raw": they are the chunk)
    fmt: TensorFormat | None = None  #: the chunk's tensor format, if it was put as a tensor
    in_s3: bool = False  #: a copy is in the S3 (remote) tier (flushed), so dropping this one loses nothing
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


class ChangeKind(enum.Enum):
    ADDED = "added"
    MOVED = "moved"
    DROPPED = "dropped"


@dataclass(frozen=True)
class Change:
    kind: ChangeKind
    chunk: StoredChunk
    cause: DropCause | None = None  #: why a DROPPED chunk was let go


@dataclass(frozen=True)
class Reservation:
    key: bytes
    offset: int  #: where to write in the DRAM segment
    length: int
    already_stored: bool = False  #: the key is held already (keys name content): nothing to write
    at: float = 0.0  #: when it was made (the store's monotonic clock): an unpublished one expires


RoomChunk = tuple[
    bytes, int, int, int, TensorFormat | None
]  #: a chunk put into a room: key, offset, length, crc, format


@dataclass(frozen=True)
class Room:
    """DRAM a writer holds for its next batch, whose keys it does not know yet: it writes chunks into it at
    offsets of its choosing (multiples of ``alignment``) and hands them over with one call, which opens the
    next room in the same reply.  A room not handed over within the reservation TTL is reclaimed."""

    id: int
    offset: int
    length: int
    alignment: int
    ttl_s: float = 30.0  #: the holder reclaims it this long after it opened it, unless filled
    at: float = 0.0  #: when it was opened (the store's monotonic clock)

    def carve(self, sizes: "list[int]") -> list[int] | None:
        """Offsets in the segment for chunks of ``sizes``, laid one after the other on ``alignment``
        boundaries; None when they do not fit."""
        offsets, at = [], self.offset
        for size in sizes:
            offsets.append(at)
            at += -(-size // self.alignment) * self.alignment
        return offsets if at <= self.offset + self.length else None

    def checked(self, items: object) -> list[RoomChunk]:
        """``items``, the chunks a writer says it put here, if each is ``(key, offset, length, checksum, format or
        None)`` inside this room on an ``alignment`` boundary and none overlaps another; ``ConfigError`` otherwise."""
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"fill_room takes a list of chunks, got {type(items).__name__}")
        out = [self._checked(item) for item in items]
        spans = sorted((offset, offset + length) for _, offset, length, _, _ in out)
        if any(end > start for (_, end), (start, _) in pairwise(spans)):
            raise ConfigError(f"chunks put into room {self.id} overlap")
        return out

    def _checked(self, item: object) -> RoomChunk:
        if not isinstance(item, tuple) or len(item) != 5:
            raise ConfigError(f"a chunk put into a room is (key, offset, length, checksum, format), got {item!r:.60}")
        key, offset, length, checksum, fmt = item
        check_key(key)
        check_checksum(checksum)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length)) or length <= 0:
            raise ConfigError(f"chunk {short(key)}: offset and length must be ints (length > 0)")
        if offset % self.alignment or not self.offset <= offset <= offset + length <= self.offset + self.length:
            raise ConfigError(
                f"chunk {short(key)} at [{offset}, +{length}) is not inside room {self.id} "
                f"[{self.offset}, +{self.length}) on a {self.alignment}-byte boundary"
            )
        if fmt is not None and (not isinstance(fmt, TensorFormat) or fmt.nbytes != length):
            raise ConfigError(f"chunk {short(key)}: its format {fmt!r:.60} does not describe {length} bytes")
        return key, offset, length, checksum, fmt


def check_length(length: int, what: str = "length") -> int:
    """``length`` if it is a byte count > 0; ``ConfigError`` naming ``what`` otherwise."""
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise ConfigError(f"{what} must be an int > 0 (bytes), got {length!r:.60}")
    return length


def check_checksum(checksum: int) -> None:
    if not isinstance(checksum, int) or isinstance(checksum, bool) or not 0 <= checksum < 2**64:
        raise ConfigError(f"checksum must be an int in [0, 2**64), got {checksum!r:.60}")


def short(key: bytes) -> str:
    return key.hex()[:16] if isinstance(key, bytes) else f"{key!r:.16}"
