"""The transfer-engine interface: one-sided reads and writes between registered memory regions.

A process registers regions (``register``), exports a ``descriptor`` that another process imports
(``connect``) and then reads or writes ranges of the peer's regions without the peer's CPU taking part.
Contract: one thread drives a transport at a time (callers serialize); every transfer either completes
or raises :class:`TransferError` within its timeout, never hangs.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One contiguous range: ``length`` bytes at ``remote_offset`` of the peer's region ``region``, and
    at ``local_address`` here (inside a region registered with this transport)."""

    region: str
    remote_offset: int
    local_address: int
    length: int


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
