"""What a node knows of each chunk it holds, and the records its store hands out: where a chunk is stored and
under which codec, whose it is, a change to publish.  (A writer's room and the other records of the node calls are in
:mod:`kvpool.pool.protocol`.)"""

import enum
import re
import sys
from dataclasses import dataclass

import crc32c
import msgspec

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


def check_length(length: int, what: str = "length") -> int:
    """``length`` if it is a byte count > 0; ``ConfigError`` naming ``what`` otherwise."""
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise ConfigError(f"{what} must be an int > 0 (bytes), got {length!r:.60}")
    return length


def short(key: bytes) -> str:
    return key.hex()[:16] if isinstance(key, bytes) else f"{key!r:.16}"
