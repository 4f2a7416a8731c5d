"""The pool's vocabulary: storage tiers, where a chunk's replica lives, and what a node contributes.

Plain frozen values with no encoding; how they are stored in etcd is :mod:`kvpool.metadata.records`.
"""

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.core.keys import CacheIdentity


class Tier(enum.Enum):
    """Storage tiers, nearest first: readers prefer a lower rank."""

    GPU = "gpu"
    DRAM = "dram"
    NVME = "nvme"
    REMOTE = "remote"

    @property
    def rank(self) -> int:
        return _TIER_RANK[self]


_TIER_RANK = {t: i for i, t in enumerate(Tier)}


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one replica of one chunk lives, and how to check it."""

    key: bytes  #: chunk key (32 bytes)
    node: str  #: holder: a node id, or the remote tier's name
    tier: Tier
    offset: int  #: where the stored bytes start in the holder's segment of ``tier`` (0 on the remote tier)
    stored: int  #: bytes stored, after the codec: what a transfer moves
    size: int  #: bytes of the chunk itself, what a reader gets (equals ``stored`` under the raw codec)
    checksum: int  #: of the stored bytes
    codec: str = "raw"
    identity: str = ""  #: fingerprint of the cache identity the writer keyed the chunk under ("": it gave none)


def nearest_first(node: str) -> Callable[["Placement"], tuple[bool, bool, int]]:
    """Sort key of a chunk's replicas, in the order a reader on Ray node ``node`` tries them (the one replica order of
    the project, as Mooncake's ``SelectBestReplica`` documents its own):

    1. this node's DRAM (a copy out of the mapped segment, no call),
    2. this node's NVMe (read from the segment file, no byte through Ray),
    3. a peer's DRAM (one-sided READ),
    4. a peer's NVMe (promoted by the peer, or sent back with its ``prepare_load`` reply),
    5. the S3 (remote) tier, whose placements name the tier, not a node.

    ``min(replicas, key=nearest_first(node))`` is the best one, ``sorted`` the order to fall back in."""
    return lambda p: (p.tier is Tier.REMOTE, p.node != node, p.tier.rank)


def nearest(replicas: Sequence[Placement], node: str) -> Placement | None:
    """The replica a reader on ``node`` reads (:func:`nearest_first`); None when there is none."""
    return min(replicas, key=nearest_first(node)) if replicas else None


@dataclass(frozen=True)
class SegmentInfo:
    """One storage segment a node contributes to the pool."""

    name: str
    tier: Tier
    capacity: int
    used: int = 0


@dataclass(frozen=True)
class NodeRecord:
    """A node of the pool, as published on its lease."""

    node_id: str
    host: str
    pid: int
    address: bytes = b""  #: the transport's address of this node (e.g. NIXL agent metadata)
    segments: tuple[SegmentInfo, ...] = field(default_factory=tuple)
    started: float = 0.0  #: when the node came up (seconds since the epoch; 0: not known)
    metrics: str = ""  #: host:port of the node's Prometheus endpoint ("" when it serves none)

    def capacity(self, tier: Tier) -> int:
        return sum(s.capacity for s in self.segments if s.tier is tier)

    def used(self, tier: Tier) -> int:
        return sum(s.used for s in self.segments if s.tier is tier)


@dataclass(frozen=True)
class IdentityRecord:
    """A cache identity a client said it uses (``PoolClient.register_identity``), who said so last, and when."""

    identity: CacheIdentity
    host: str
    pid: int
    at: float  #: seconds since the epoch


class DropCause(enum.Enum):
    """Why a node let a chunk go (what a tombstone remembers)."""

    EVICTED = "evicted"  #: made room: no tier below could take it
    REMOVED = "removed"  #: a client or an operator removed it
    CORRUPT = "corrupt"  #: its bytes failed their checksum


@dataclass(frozen=True)
class Tombstone:
    """A chunk a node dropped: why, from which tier, when, and (evictions) by which policy."""

    key: bytes
    node: str
    cause: DropCause
    tier: Tier
    at: float  #: seconds since the epoch
    policy: str = ""  #: the eviction policy, for an eviction


@dataclass(frozen=True)
class Departure:
    """A node whose record left etcd (its lease ran out, or it shut down): every chunk it held went with it."""

    node: str
    revision: int  #: the etcd revision that deleted its record (and, with its lease, its placements)
    at: float  #: when a surviving node saw it, seconds since the epoch
