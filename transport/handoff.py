"""Producer → consumer handoff without a copy in between (Mooncake Transfer Engine style).

A prefill worker (the producer) registers the buffer holding a request's KV with its transport and
hands a :class:`Handoff` to a decode worker (through Ray, HTTP, anything: it is a small frozen record).
The consumer READs the bytes straight out of the producer's memory; the READ carries a notification,
and :func:`wait_taken` on the producer's side returns once it has arrived: the buffer may be freed.
"""

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.errors import ConfigError
from kvpool.transport.base import Op
from kvpool.transport.nixl import NixlTransport


@dataclass(frozen=True)
class Handoff:
    descriptor: bytes  #: the producer transport's descriptor (its agent and regions)
    region: str  #: the region holding the bytes
    length: int
    token: bytes  #: the notification the consumer's READ carries

    def __post_init__(self) -> None:
        for name in ("descriptor", "token"):
            if not isinstance(getattr(self, name), bytes) or not getattr(self, name):
                raise ConfigError(f"Handoff.{name} must be non-empty bytes, got {getattr(self, name)!r:.60}")
        if not isinstance(self.region, str) or not self.region:
            raise ConfigError(f"Handoff.region must be a region name, got {self.region!r:.60}")
        if not isinstance(self.length, int) or isinstance(self.length, bool) or self.length <= 0:
            raise ConfigError(f"Handoff.length must be an int > 0 (bytes), got {self.length!r:.60}")


def _address(buffer: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a C-contiguous CPU buffer (bytes-like, numpy array or CPU tensor)."""
    if hasattr(buffer, "data_ptr"):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ConfigError("hand off contiguous CPU tensors (GPU memory needs a VRAM registration)")
        return int(buffer.data_ptr()), int(buffer.numel() * buffer.element_size())
    arr = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer
    if not arr.flags.c_contiguous:
        raise ConfigError("hand off C-contiguous buffers")
    return int(arr.ctypes.data), int(arr.nbytes)


def offer(transport: NixlTransport, buffer: Any) -> Handoff:
    """Register ``buffer`` on the producer's (serving) transport; the buffer must stay alive and
    unchanged until :func:`wait_taken` returns."""
    address, length = _address(buffer)
    region = f"handoff-{uuid.uuid4().hex}"
    transport.register(region, address, length)
    return Handoff(transport.descriptor(), region, length, token=region.encode())


def take(transport: NixlTransport, handoff: Handoff, dest: Any, timeout_s: float = 30.0) -> None:
    """Consumer: READ the handed-off bytes into ``dest`` (exactly ``handoff.length`` bytes), then the
    producer is notified.  ``TransferError`` if the producer is gone or the deadline passes."""
    address, length = _address(dest)
    if length != handoff.length:
        raise ConfigError(f"destination holds {length} bytes, the handoff {handoff.length}")
    local = f"take-{uuid.uuid4().hex}"
    transport.register(local, address, length)
    try:
        peer = transport.connect(handoff.descriptor)
        transport.read(peer, [Op(handoff.region, 0, address, length)], timeout_s, notify=handoff.token)
    finally:
        transport.deregister(local)


def wait_taken(transport: NixlTransport, handoff: Handoff, timeout_s: float = 30.0) -> str:
    """Producer: wait until a consumer has taken the bytes, then stop serving them; returns the consumer.
    On ``TransferError`` (nobody took them in time) the region stays registered: retry or ``withdraw``."""
    consumer = transport.wait_notification(handoff.token, timeout_s)
    transport.deregister(handoff.region)
    return consumer


def withdraw(transport: NixlTransport, handoff: Handoff) -> None:
    """Producer: stop serving a handoff nobody took."""
    transport.deregister(handoff.region)
