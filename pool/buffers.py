"""Byte views of what callers hand the pool: bytes, memoryview, numpy arrays, CPU torch tensors.

Views, never copies: a non-contiguous array or a GPU tensor is refused with a ``ConfigError`` that says what to
hand instead, rather than silently copied.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.errors import ConfigError

if TYPE_CHECKING:
    import torch


def byte_view(data: Any, *, writable: bool = False, field: str = "data") -> memoryview:
    """A flat ``uint8`` memoryview over ``data``'s memory (the segments' reads and writes take any buffer through it,
    so plain buffers come first)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        data = _array(data, field)
    try:
        view = memoryview(data)
    except TypeError:
        raise ConfigError(
            f"{field} must be bytes, bytearray, memoryview, a numpy array or a CPU torch tensor, "
            f"got {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ConfigError(f"{field} is a non-contiguous buffer")
    if writable and view.readonly:
        raise ConfigError(f"{field} is read-only; pass a writable buffer (bytearray, numpy array, tensor)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _array(data: Any, field: str) -> Any:
    """A CPU torch tensor or a numpy array as a flat uint8 array over the same memory; anything else as it is."""
    if hasattr(data, "data_ptr") and hasattr(data, "is_contiguous"):  # a torch tensor, without importing torch
        if data.device.type != "cpu":
            raise ConfigError(
                f"{field} is a tensor on {data.device}; the pool takes CPU tensors (copy it to host first)"
            )
        data = tensor_bytes(data, field).numpy()
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ConfigError(f"{field} is a non-contiguous array; use np.ascontiguousarray first")
        data = data.reshape(-1).view(np.uint8)
    return data


def tensor_bytes(t: object, field: str) -> "torch.Tensor":
    """``t``'s memory, on whichever device, as a flat uint8 tensor (a view, never a copy); ``ConfigError`` naming
    ``field`` unless ``t`` is a dense, contiguous torch tensor.  Imports torch when called."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{field} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided or not t.is_contiguous():
        raise ConfigError(f"{field} must be a dense, contiguous tensor (call .contiguous() first)")
    if t.is_conj() or t.is_neg():
        raise ConfigError(f"{field} is a lazy conjugate/negative view; call .resolve_conj()/.resolve_neg() first")
    return t.detach().reshape(-1).view(torch.uint8)


def pieces_of(buffers: Any, *, writable: bool = True, field: str = "buffers") -> list[list[memoryview]]:
    """Per buffer, the byte views its chunk's bytes fill (a read) or come from (a write), in order.  A buffer is its
    own one piece; a list of buffers is one chunk spread over several regions (a run of KV blocks, say)."""
    return [
        [byte_view(p, writable=writable, field=f"{field}[{i}]") for p in (b if isinstance(b, (list, tuple)) else [b])]
        for i, b in enumerate(buffers)
    ]


def joined(pieces: list[memoryview]) -> memoryview:
    """One byte view a read that cannot fill ``pieces`` directly lands in: the one piece itself, or a scratch buffer
    of their size that :func:`scatter` then copies into them."""
    if len(pieces) == 1:
        return pieces[0]
    return byte_view(np.empty(sum(p.nbytes for p in pieces), dtype=np.uint8), writable=True)


def scatter(view: memoryview, pieces: list[memoryview]) -> None:
    """Copy ``view`` into ``pieces`` in order (nothing when the view is the one piece)."""
    if len(pieces) == 1 and pieces[0] is view:
        return
    at = 0
    for p in pieces:
        p[:] = view[at : at + p.nbytes]
        at += p.nbytes


def one_per_key(keys: Sequence[Any], given: Sequence[Any], what: str) -> None:
    """Refuse a batch whose ``what`` list (buffers, tensors) does not pair one to one with its keys."""
    if len(keys) != len(given):
        raise ConfigError(f"{len(keys)} keys but {len(given)} {what}s: pass one {what} per key")
