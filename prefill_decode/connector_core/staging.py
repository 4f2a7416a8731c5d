"""One reusable host staging buffer: KV bytes pass through it between an engine's cache and the pool."""

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from kvpool.errors import KvPoolError

log = logging.getLogger(__name__)


class Registrar(Protocol):
    """What staging needs of a pool client: ``PoolClient.register_buffer`` / ``unregister_buffer``."""

    def register_buffer(self, buffer: Any) -> None: ...

    def unregister_buffer(self, buffer: Any) -> None: ...


class HostStaging:
    """A flat ``uint8`` host buffer, reused by every transfer (no page faults per step) and grown, to twice its size
    or what is asked if more, when a transfer needs more.  Registered with the client's transport once (for the
    buffer it is), when a caller says reads from other nodes will land in it: they then land without a second copy."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._registered = False

    def get(self, client: Registrar, nbytes: int, *, register: bool = False) -> torch.Tensor:
        """The buffer, at least ``nbytes`` long (slice and ``.view(dtype)`` it); ``register``: with ``client``'s
        transport (the client a connector makes, maybe late: always the same one)."""
        old = self._buffer
        if old is None or old.numel() < nbytes:
            self.close(client)
            self._buffer = torch.empty(max(nbytes, 0 if old is None else 2 * old.numel()), dtype=torch.uint8)
        buffer = self._buffer
        assert buffer is not None
        if register and not self._registered:
            client.register_buffer(buffer)
            self._registered = True
        return buffer

    @property
    def nbytes(self) -> int:
        """The buffer's size now (0 before the first :meth:`get`, or if nothing ever needed staging)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def close(self, client: Registrar) -> None:
        """Unregister and drop the buffer (the next :meth:`get` makes a new one)."""
        if self._buffer is not None and self._registered:
            client.unregister_buffer(self._buffer)
        self._buffer, self._registered = None, False


class EngineMemory:
    """An engine's own KV memory (vLLM's KV tensors, SGLang's host pool) registered with a pool client's transport,
    once: reads from other nodes then land in it with no staging copy.  A registration that fails is logged and not
    tried again (those reads go through the client's staging buffer, one checked copy on)."""

    def __init__(self) -> None:
        self._buffers: list[Any] | None = None  #: None: not tried yet

    def register(self, client: Registrar, buffers: Callable[[], Iterable[Any]]) -> None:
        """Register ``buffers()`` with ``client`` unless this was tried before."""
        if self._buffers is not None:
            return
        self._buffers = []
        try:
            for buffer in buffers():
                client.register_buffer(buffer)
                self._buffers.append(buffer)
        except KvPoolError as exc:
            log.warning(
                "kvpool: engine KV memory not registered with the transport (%s); peer reads go via staging", exc
            )

    @property
    def registered(self) -> bool:
        return bool(self._buffers)

    def close(self, client: Registrar) -> None:
        """Unregister what was registered (a later :meth:`register` registers again)."""
        for buffer in self._buffers or []:
            client.unregister_buffer(buffer)
        self._buffers = None
