"""The transfer-engine interface: one-sided reads and writes between registered memory regions.

A process registers regions (``register``), exports a ``descriptor`` that another process imports
(``connect``) and then reads or writes ranges of the peer's regions without the peer's CPU taking part.
Contract: one thread drives a transport at a time (callers serialize); every transfer either completes
or raises :class:`TransferError` within its timeout, never hangs.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvpool.errors import ConfigError, TransferError

_U64 = 2**64


@dataclass(frozen=True)
class Op:
    """One contiguous range: ``length`` bytes at ``remote_offset`` of the peer's region ``region``, and
    at ``local_address`` here (inside a region registered with this transport)."""

    region: str
    remote_offset: int
    local_address: int
    length: int

    def __post_init__(self) -> None:
        # checked here, not by the engine: a negative length reaches memmove as 2**64 - 1
        if not isinstance(self.region, str) or not self.region:
            raise ConfigError(f"Op.region must be a region name, got {self.region!r:.60}")
        for name, low in (("remote_offset", 0), ("local_address", 1), ("length", 1)):
            value = getattr(self, name)
            if not is_int_in(value, low, _U64):
                raise ConfigError(f"Op.{name} must be an int in [{low}, 2**64), got {value!r:.60}")


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


def is_int_in(value: object, low: int, high: int) -> bool:
    """Whether ``value`` is an int (not a bool) in ``[low, high)``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def unpack_descriptor(raw: bytes, kind: str, version: int, fields: frozenset[str], scope: str) -> dict[str, Any]:
    """The map of a ``kind`` descriptor: msgpack holding exactly ``fields`` (``"v"`` == ``version``, a non-empty
    ``"name"``, ``"scope"`` == ``scope``); ``TransferError`` saying what is wrong otherwise.  Pure: transports
    call it before any engine sees the descriptor, then check the fields of their own."""
    try:
        d = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise TransferError(f"malformed {kind} descriptor: not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(d, dict) or type(d.get("v")) is not int or d["v"] != version:
        got = f"version {d.get('v')!r:.40}" if isinstance(d, dict) else type(d).__name__
        raise TransferError(f"malformed {kind} descriptor: not a kvpool map of version {version} (got {got})")
    if set(d) != fields:
        raise TransferError(
            f"malformed {kind} descriptor: fields {sorted(map(repr, d))} where {sorted(fields)} were due "
            "(made by another kvpool version?)"
        )
    name = d["name"]
    if not isinstance(name, str) or not name:
        raise TransferError(f"malformed {kind} descriptor: name {name!r:.60} is not a peer name")
    if d["scope"] != scope:
        raise TransferError(f"descriptor of {name} belongs to cluster {d['scope']!r:.60}, this transport to {scope!r}")
    return d
