"""The values kvpool stores in etcd, and their msgpack encoding.

Every value is a msgpack map with a schema version ``"v"``.  Decoding is strict: anything that is not
a map of the expected fields and types raises :class:`MalformedRecord`, which readers log and skip,
so one bad value never crashes a reader.  The chunk key and the holding node live in the etcd key,
not in the value (see :mod:`kvpool.metadata.namespace`).
"""

import enum
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from kvpool.errors import MalformedRecord

SCHEMA_VERSION = 1


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


def _pack(fields: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, **fields}, use_bin_type=True)


_Spec = dict[str, type | tuple[type, ...]]


def _unpack(kind: str, raw: bytes, spec: _Spec, optional: _Spec | None = None) -> dict[str, Any]:
    """The fields of one record: exactly ``"v"``, every field of ``spec`` and maybe those of ``optional``, each
    of its type (``bool`` is never an ``int``, floats are finite); ``MalformedRecord`` otherwise."""
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MalformedRecord(f"{kind}: not msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise MalformedRecord(f"{kind}: expected a map, got {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise MalformedRecord(f"{kind}: schema version {version!r:.40}, this kvpool reads {SCHEMA_VERSION}")
    optional = optional or {}
    unknown = [k for k in obj if k != "v" and k not in spec and k not in optional]
    if unknown:
        raise MalformedRecord(f"{kind}: unknown fields {unknown!r:.80} (written by another kvpool version?)")
    for name, typ in {**spec, **optional}.items():
        if name not in obj:
            if name in optional:
                continue
            raise MalformedRecord(f"{kind}: field {name!r} missing")
        value = obj[name]
        if not isinstance(value, typ) or isinstance(value, bool):
            raise MalformedRecord(f"{kind}: field {name!r} has type {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise MalformedRecord(f"{kind}: field {name!r} is {value}")
    return obj


def _tier(kind: str, value: str) -> Tier:
    try:
        return Tier(value)
    except ValueError:
        raise MalformedRecord(f"{kind}: unknown tier {value!r}") from None


@dataclass(frozen=True)
class Placement:
    """Where one replica of one chunk lives, and how to check it."""

    key: bytes  #: chunk key (32 bytes)
    node: str  #: holder: a node id, or the remote tier's name
    tier: Tier
    segment: str
    offset: int
    length: int  #: bytes stored (after the codec)
    checksum: int
    codec: str = "raw"
    checksum_alg: str = "crc32c"
    created: float = 0.0
    last_access: float = 0.0
    size: int = 0  #: bytes of the chunk itself, what a reader gets (0 or absent: ``length``; differs under a codec)

    _SPEC: ClassVar[_Spec] = {
        "tier": str, "segment": str, "offset": int, "length": int, "checksum": int,
        "codec": str, "checksum_alg": str, "created": (int, float), "last_access": (int, float),
    }  # fmt: skip

    def encode(self) -> bytes:
        return _pack(
            {
                "tier": self.tier.value, "segment": self.segment, "offset": self.offset, "length": self.length,
                "checksum": self.checksum, "codec": self.codec, "checksum_alg": self.checksum_alg,
                "created": self.created, "last_access": self.last_access, "size": self.raw_size,
            }
        )  # fmt: skip

    def __post_init__(self) -> None:
        if not self.size:  # a chunk stored raw: what a reader gets is what is stored
            object.__setattr__(self, "size", self.length)

    @property
    def raw_size(self) -> int:
        return self.size

    @classmethod
    def decode(cls, key: bytes, node: str, raw: bytes) -> "Placement":
        f = _unpack("placement", raw, cls._SPEC, {"size": int})  # size came with the codecs
        size = f.get("size", f["length"])
        if f["offset"] < 0 or f["length"] < 1 or f["checksum"] < 0 or size < 1:
            raise MalformedRecord(
                f"placement: offset {f['offset']} and checksum {f['checksum']} must be >= 0, length {f['length']} "
                f"and size {size} >= 1"
            )
        return cls(
            key=key, node=node, tier=_tier("placement", f["tier"]), segment=f["segment"], offset=f["offset"],
            length=f["length"], checksum=f["checksum"], codec=f["codec"], checksum_alg=f["checksum_alg"],
            created=float(f["created"]), last_access=float(f["last_access"]), size=size,
        )  # fmt: skip


@dataclass(frozen=True)
class SegmentInfo:
    """One storage segment a node contributes to the pool."""

    name: str
    tier: Tier
    capacity: int
    used: int = 0

    def to_wire(self) -> list[Any]:
        return [self.name, self.tier.value, self.capacity, self.used]

    @classmethod
    def from_wire(cls, item: Any) -> "SegmentInfo":
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and isinstance(item[1], str)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in item[2:])):  # fmt: skip
            raise MalformedRecord(
                f"node record: segment entry {item!r:.80} is not [name, tier, capacity >= 0, used >= 0]"
            )
        return cls(item[0], _tier("node record", item[1]), item[2], item[3])


@dataclass(frozen=True)
class NodeRecord:
    """A node of the pool, as published on its lease."""

    node_id: str
    host: str
    pid: int
    address: bytes = b""  #: the transport's address of this node (e.g. NIXL agent metadata)
    segments: tuple[SegmentInfo, ...] = field(default_factory=tuple)
    started: float = 0.0
    updated: float = 0.0
    metrics: str = ""  #: host:port of the node's Prometheus endpoint ("" when it serves none)

    _SPEC: ClassVar[_Spec] = {
        "host": str, "pid": int, "address": bytes, "segments": list, "started": (int, float), "updated": (int, float),
    }  # fmt: skip

    def encode(self) -> bytes:
        return _pack(
            {
                "host": self.host, "pid": self.pid, "address": self.address,
                "segments": [s.to_wire() for s in self.segments], "started": self.started, "updated": self.updated,
                "metrics": self.metrics,
            }
        )  # fmt: skip

    @classmethod
    def decode(cls, node_id: str, raw: bytes) -> "NodeRecord":
        f = _unpack("node record", raw, cls._SPEC, {"metrics": str})  # metrics came later
        if not 0 < f["pid"] < 2**31:
            raise MalformedRecord(f"node record: pid {f['pid']} is not a process id")
        return cls(
            node_id=node_id, host=f["host"], pid=f["pid"], address=f["address"],
            segments=tuple(SegmentInfo.from_wire(s) for s in f["segments"]),
            started=float(f["started"]), updated=float(f["updated"]), metrics=f.get("metrics", ""),
        )  # fmt: skip

    def capacity(self, tier: Tier) -> int:
        return sum(s.capacity for s in self.segments if s.tier is tier)

    def used(self, tier: Tier) -> int:
        return sum(s.used for s in self.segments if s.tier is tier)
