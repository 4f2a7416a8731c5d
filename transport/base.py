"""The transfer-engine interface: one-sided reads and writes between registered memory regions.

A process registers regions (``register``), exports a ``descriptor`` that another process imports
(``connect``) and then reads or writes ranges of the peer's regions without the peer's CPU taking part.
Contract: one thread drives a transport at a time (callers serialize); every transfer either completes
or raises :class:`TransferError` within its timeout, never hangs.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cache
from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from kvpool.core.config import Config
from kvpool.errors import TransferError

_I64_MAX = 2**63 - 1  #: msgspec bounds ints to int64; an address or offset beyond is no memory we have


class Op(Config, frozen=True):
    """One contiguous range: ``length`` bytes at ``remote_offset`` of the peer's region ``region``, and
    at ``local_address`` here (inside a region registered with this transport).  Checked when made, not by the
    engine: a negative length reaches memmove as 2**64 - 1."""

    region: Annotated[str, Meta(min_length=1, description="a region name")]
    remote_offset: Annotated[int, Meta(ge=0, le=_I64_MAX, description="an int in [0, 2**63)")]
    local_address: Annotated[int, Meta(ge=1, le=_I64_MAX, description="an int in [1, 2**63)")]
    length: Annotated[int, Meta(ge=1, le=_I64_MAX, description="an int in [1, 2**63)")]


class Transport(ABC):
    @abstractmethod
    def register(self, name: str, address: int, length: int) -> None:
        """Make ``[address, address+length)`` reachable by peers (as ``name``) and usable as a local end."""

    @abstractmethod
    def deregister(self, name: str) -> None:
        """Stop serving region ``name`` (no transfer may be in flight on it)."""

    @abstractmethod
    def descriptor(self) -> bytes:
        """What a peer passes to :meth:`connect` to reach this transport's regions."""

    @abstractmethod
    def connect(self, descriptor: bytes) -> str:
        """Import a peer's descriptor; returns the peer's id for :meth:`read` / :meth:`write`."""

    @abstractmethod
    def read(self, peer: str, ops: Sequence[Op], timeout_s: float, notify: bytes = b"") -> None:
        """Copy each op's remote range into its local range; all done, or ``TransferError``.  A non-empty
        ``notify`` is delivered to the peer once the transfer is complete (see :meth:`wait_notification`)."""

    @abstractmethod
    def write(self, peer: str, ops: Sequence[Op], timeout_s: float, notify: bytes = b"") -> None:
        """Copy each op's local range into its remote range; all done, or ``TransferError``."""

    @abstractmethod
    def wait_notification(self, message: bytes, timeout_s: float) -> str:
        """Block until a peer's transfer carrying ``notify=message`` has completed; returns the peer's id,
        or ``TransferError`` after ``timeout_s``."""

    @property
    def fencing(self) -> bool:
        """Whether any memory is fenced now (:meth:`fenced`)."""
        return False

    def fenced(self, address: int, length: int) -> bool:
        """Whether a transfer that passed its deadline may still write into ``[address, +length)`` of this
        process's memory (a transport whose transfers always end by their deadline has none)."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Deregister everything and drop every peer."""


def pop_notification(pending: list[tuple[str, bytes]], message: bytes) -> str | None:
    """Remove the oldest ``(peer, message)`` from ``pending``; its peer, or None when it has not come yet."""
    for i, (peer, msg) in enumerate(pending):
        if msg == message:
            del pending[i]
            return peer
    return None


# -- descriptors: the wire formats, decoded strictly by msgspec --------------------------------------------

_Name = Annotated[str, Meta(min_length=1)]
_Offset = Annotated[int, Meta(ge=0, le=2**63 - 1)]
_Length = Annotated[int, Meta(ge=1, le=2**63 - 1)]
_Token = Annotated[bytes, Meta(min_length=1)]


class Descriptor(Struct, forbid_unknown_fields=True):
    """What every descriptor holds: its version, the peer's name and the cluster (scope) it belongs to."""

    v: Literal[1]
    name: _Name
    scope: str


class NixlRegion(Struct, array_like=True, forbid_unknown_fields=True):
    """``[address, length]`` of a region a NIXL peer registered."""

    address: _Offset
    length: _Length


class NixlDescriptor(Descriptor):
    agent: _Token  #: the NIXL agent's metadata
    regions: dict[_Name, NixlRegion]


D = TypeVar("D", bound=Descriptor)


@cache
def _decoder(wire: type[D]) -> msgspec.msgpack.Decoder[D]:
    return msgspec.msgpack.Decoder(wire)


def decode_descriptor(raw: bytes, wire: type[D], kind: str, scope: str) -> D:
    """The ``kind`` descriptor ``raw`` holds, of exactly the fields and types of ``wire``, made in cluster
    ``scope``; ``TransferError`` saying what is wrong otherwise.  Pure: transports call it before any engine
    sees the descriptor."""
    try:
        d = _decoder(wire).decode(raw)
    except (msgspec.DecodeError, TypeError) as exc:  # TypeError: not bytes at all
        said = str(exc)
        if "`$.v`" in said or "field `v`" in said or "unknown field" in said:
            said += " (made by another kvpool version? run the same kvpool on every node)"
        raise TransferError(f"malformed {kind} descriptor: {said}") from None
    if d.scope != scope:
        raise TransferError(f"descriptor of {d.name} belongs to cluster {d.scope!r:.60}, this transport to {scope!r}")
    return d
