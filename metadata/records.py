"""The values kvpool stores in etcd, and their msgpack encoding.

Every value is a msgpack map with a schema version ``"v"``, described by a strict ``msgspec`` Struct
below (the wire format); the values themselves are the pool's (:mod:`kvpool.core.types`).  Decoding is
strict: anything that is not a map of exactly the expected fields and types (``bool`` is never an
``int``, floats are finite, offsets and sizes are in range) raises :class:`MalformedRecord`, which
readers log and skip, so one bad value never crashes a reader.  The chunk key and the holding node live
in the etcd key, not in the value (see :mod:`kvpool.metadata.namespace`).
"""

import sys
from typing import Annotated, Any, Final, Literal, get_args

import msgspec
from msgspec import Meta, Struct

from kvpool.core.keys import CacheIdentity
from kvpool.core.types import (
    Departure,
    DropCause,
    IdentityRecord,
    NodeRecord,
    Placement,
    SegmentInfo,
    Tier,
    Tombstone,
)
from kvpool.errors import ConfigError, MalformedRecord
from kvpool.metadata.namespace import FINGERPRINT_HEX

__all__ = [
    "SCHEMA_VERSION",
    "decode_departure",
    "decode_identity",
    "decode_node",
    "decode_placement",
    "decode_tombstone",
    "encode_departure",
    "encode_identity",
    "encode_node",
    "encode_placement",
    "encode_tombstone",
]

#: 2: placements carry ``stored`` and ``size`` (no 0-sentinel); write-only fields gone.  3: placements carry the
#: fingerprint of the cache identity their chunk was put under (chunk events report it)
SCHEMA_VERSION: Final = 3
_Version = Literal[3]  # msgspec needs the literal itself; kept equal to SCHEMA_VERSION (checked below)

_NonNegative = Annotated[int, Meta(ge=0)]
_Positive = Annotated[int, Meta(ge=1)]
_Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]  # NaN fails both bounds
_Pid = Annotated[int, Meta(gt=0, lt=2**31)]
_Fingerprint = Annotated[str, Meta(pattern=rf"^([0-9a-f]{{{FINGERPRINT_HEX}}})?\Z")]  #: "": put without an identity


class _PlacementWire(Struct, forbid_unknown_fields=True):
    """A placement in etcd; the key and the holder are in the etcd key."""

    v: _Version
    tier: Tier
    offset: _NonNegative
    stored: _Positive
    size: _Positive
    checksum: _NonNegative
    codec: str
    identity: _Fingerprint


class _SegmentWire(Struct, array_like=True, forbid_unknown_fields=True):
    """``[name, tier, capacity, used]``."""

    name: str
    tier: Tier
    capacity: _NonNegative
    used: _NonNegative


class _NodeWire(Struct, forbid_unknown_fields=True):
    """A node record in etcd; the node id is in the etcd key."""

    v: _Version
    host: str
    pid: _Pid
    address: bytes
    segments: list[_SegmentWire]
    started: _Finite
    metrics: str


class _IdentityWire(Struct, forbid_unknown_fields=True):
    """A cache identity a client registered; its fingerprint is in the etcd key."""

    v: _Version
    model: str
    kv_dtype: str
    layout: str
    chunk_size: _Positive
    tp_size: _Positive
    tp_rank: _NonNegative
    codec: str
    host: str
    pid: _Pid
    at: _Finite


assert get_args(_Version) == (SCHEMA_VERSION,), "bump both together"


class _TombstoneWire(Struct, forbid_unknown_fields=True):
    """A dropped chunk in etcd; the key and the node are in the etcd key."""

    v: _Version
    cause: DropCause
    tier: Tier
    at: _Finite
    policy: str


class _DepartureWire(Struct, forbid_unknown_fields=True):
    """A node that left; its id is in the etcd key."""

    v: _Version
    revision: _Positive
    at: _Finite


_ENCODER = msgspec.msgpack.Encoder()
_PLACEMENT_DECODER = msgspec.msgpack.Decoder(_PlacementWire)
_NODE_DECODER = msgspec.msgpack.Decoder(_NodeWire)
_IDENTITY_DECODER = msgspec.msgpack.Decoder(_IdentityWire)
_TOMBSTONE_DECODER = msgspec.msgpack.Decoder(_TombstoneWire)
_DEPARTURE_DECODER = msgspec.msgpack.Decoder(_DepartureWire)
_ANY_MAP = msgspec.msgpack.Decoder(dict[str, Any])


def _malformed(kind: str, raw: object, exc: Exception) -> MalformedRecord:
    """What is wrong with ``raw``, as a ``MalformedRecord`` naming ``kind`` (on the error path only)."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        return MalformedRecord(f"{kind}: expected bytes, got {type(raw).__name__}")
    if not isinstance(exc, msgspec.ValidationError):
        return MalformedRecord(f"{kind}: not msgpack ({exc})")
    try:
        version = _ANY_MAP.decode(raw).get("v")
    except msgspec.DecodeError:
        return MalformedRecord(f"{kind}: {exc} (expected a map of its fields)")
    if type(version) is not int or version != SCHEMA_VERSION:
        return MalformedRecord(
            f"{kind}: schema version {version!r:.40}, this kvpool reads {SCHEMA_VERSION}: written by another kvpool "
            "version? run one version per cluster"
        )
    return MalformedRecord(f"{kind}: {exc}")


def encode_placement(p: Placement) -> bytes:
    wire = _PlacementWire(SCHEMA_VERSION, p.tier, p.offset, p.stored, p.size, p.checksum, p.codec, p.identity)
    return _ENCODER.encode(wire)


def decode_placement(key: bytes, node: str, raw: bytes) -> Placement:
    """The placement of ``key`` held by ``node`` that ``raw`` encodes; ``MalformedRecord`` if it is not one.  Its codec
    and identity are interned: a watch cache holds thousands of placements that name a handful of each."""
    try:
        w = _PLACEMENT_DECODER.decode(raw)
    except (msgspec.DecodeError, TypeError) as exc:
        raise _malformed("placement", raw, exc) from None
    return Placement(
        key, node, w.tier, w.offset, w.stored, w.size, w.checksum, sys.intern(w.codec), sys.intern(w.identity)
    )


def encode_node(r: NodeRecord) -> bytes:
    segments = [_SegmentWire(s.name, s.tier, s.capacity, s.used) for s in r.segments]
    return _ENCODER.encode(_NodeWire(SCHEMA_VERSION, r.host, r.pid, r.address, segments, r.started, r.metrics))


def decode_node(node_id: str, raw: bytes) -> NodeRecord:
    """The record of node ``node_id`` that ``raw`` encodes; ``MalformedRecord`` if it is not one."""
    try:
        w = _NODE_DECODER.decode(raw)
    except (msgspec.DecodeError, TypeError) as exc:
        raise _malformed("node record", raw, exc) from None
    segments = tuple(SegmentInfo(s.name, s.tier, s.capacity, s.used) for s in w.segments)
    return NodeRecord(node_id, w.host, w.pid, w.address, segments, w.started, w.metrics)


def encode_identity(r: IdentityRecord) -> bytes:
    i = r.identity
    wire = _IdentityWire(
        SCHEMA_VERSION, i.model, i.kv_dtype, i.layout, i.chunk_size, i.tp_size, i.tp_rank, i.codec, r.host, r.pid, r.at
    )
    return _ENCODER.encode(wire)


def decode_identity(raw: bytes) -> IdentityRecord:
    """The identity record ``raw`` encodes; ``MalformedRecord`` if it is not one."""
    try:
        w = _IDENTITY_DECODER.decode(raw)
    except (msgspec.DecodeError, TypeError) as exc:
        raise _malformed("identity record", raw, exc) from None
    try:
        identity = CacheIdentity(w.model, w.kv_dtype, w.layout, w.chunk_size, w.tp_size, w.tp_rank, w.codec)
    except ConfigError as exc:
        raise MalformedRecord(f"identity record: {exc}") from None
    return IdentityRecord(identity, w.host, w.pid, w.at)


def encode_tombstone(t: Tombstone) -> bytes:
    return _ENCODER.encode(_TombstoneWire(SCHEMA_VERSION, t.cause, t.tier, t.at, t.policy))


def decode_tombstone(key: bytes, node: str, raw: bytes) -> Tombstone:
    """The tombstone of chunk ``key`` on ``node`` that ``raw`` encodes; ``MalformedRecord`` if it is not one."""
    try:
        w = _TOMBSTONE_DECODER.decode(raw)
    except (msgspec.DecodeError, TypeError) as exc:
        raise _malformed("tombstone", raw, exc) from None
    return Tombstone(key, node, w.cause, w.tier, w.at, w.policy)


def encode_departure(d: Departure) -> bytes:
    return _ENCODER.encode(_DepartureWire(SCHEMA_VERSION, d.revision, d.at))


def decode_departure(node: str, raw: bytes) -> Departure:
    """The departure of ``node`` that ``raw`` encodes; ``MalformedRecord`` if it is not one."""
    try:
        w = _DEPARTURE_DECODER.decode(raw)
    except (msgspec.DecodeError, TypeError) as exc:
        raise _malformed("departure", raw, exc) from None
    return Departure(node, w.revision, w.at)
