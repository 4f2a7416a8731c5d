"""Byte views of what callers hand the pool: bytes, memoryview, numpy arrays, CPU torch tensors.

Views, never copies: a non-contiguous array or a GPU tensor is refused with a ``ConfigError`` that says what to
hand instead, rather than silently copied.
"""

from typing import Any

import numpy as np

from kvpool.errors import ConfigError


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
        if not data.is_contiguous():
            raise ConfigError(f"{field} is a non-contiguous tensor; call .contiguous() first")
        import torch

        data = data.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ConfigError(f"{field} is a non-contiguous array; use np.ascontiguousarray first")
        data = data.reshape(-1).view(np.uint8)
    return data
