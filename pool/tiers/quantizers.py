"""The base stage of a codec: a tensor to parameters plus one code word per value, and back (``raw``, ``fp8-*``,
``int4``; the formats are described in :mod:`kvpool.pool.tiers.codecs`).  torch is imported by the methods that
make or read tensors, so a process that only moves raw bytes never loads it."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import numpy as np
from msgspec import Meta

from kvpool.core.config import checked
from kvpool.errors import UndecodableChunk, UnencodableTensor

if TYPE_CHECKING:
    import torch

DEFAULT_GROUP = 32
_FP16_SAFE = 60000.0  # int4 parameters are float16 while every |x| is below this


def _tokens(shape: tuple[int, ...]) -> int:
    """The length of the token axis: axis 0, or 1 for a one-axis tensor (a single token)."""
    return shape[0] if len(shape) >= 2 else 1


def _by_token(codes: np.ndarray, tokens: int) -> np.ndarray:
    """``codes`` as ``[tokens, words per token]`` (a view)."""
    return codes.reshape(tokens, codes.size // tokens if tokens else 0)


class Quantizer(ABC):
    """The base stage of a codec: a tensor to parameters plus one code word per value, and back."""

    lossless: ClassVar[bool] = False

    @property
    @abstractmethod
    def spec(self) -> str:
        """This stage's part of the codec name."""

    @abstractmethod
    def bits(self, dtype: torch.dtype) -> int:
        """Bits of one code word; the delta stage works modulo ``2**bits``."""

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> tuple[bytes, np.ndarray]:
        """``(parameters, codes)`` of a contiguous CPU tensor; codes ``[T, words per token]``, unsigned or wrapping."""

    @abstractmethod
    def params_nbytes(self, shape: tuple[int, ...], body: memoryview) -> int:
        """Length of the parameters at the start of ``body`` (raises ``UndecodableChunk`` if they can't be sized)."""

    @abstractmethod
    def max_params_nbytes(self, shape: tuple[int, ...]) -> int:
        """The most parameter bytes a tensor of ``shape`` can have."""

    @abstractmethod
    def codes_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Length of the packed codes of a tensor of ``shape`` and ``dtype``."""

    def pack(self, codes: np.ndarray) -> np.ndarray:
        """Code words to their stored bytes (a contiguous array)."""
        return np.ascontiguousarray(codes)

    @abstractmethod
    def unpack(self, packed: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
        """Stored bytes (exactly ``codes_nbytes`` long) to writable code words ``[T, words per token]``."""

    @abstractmethod
    def dequantize(
        self, params: memoryview, codes: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """The tensor back, in ``dtype`` and ``shape``."""


@dataclass(frozen=True)
class Raw(Quantizer):
    """The tensor's own bytes; code words are its 16- or 32-bit patterns."""

    lossless: ClassVar[bool] = True
    #: code words by itemsize: numpy dtype, torch dtype name
    _WORDS: ClassVar[dict[int, tuple[str, str]]] = {2: ("<i2", "int16"), 4: ("<i4", "int32")}

    @property
    def spec(self) -> str:
        return "raw"

    def bits(self, dtype: torch.dtype) -> int:
        return dtype.itemsize * 8

    def quantize(self, x: torch.Tensor) -> tuple[bytes, np.ndarray]:
        import torch

        words = x.view(getattr(torch, self._WORDS[x.dtype.itemsize][1])).numpy()
        return b"", _by_token(words, _tokens(tuple(x.shape)))

    def params_nbytes(self, shape: tuple[int, ...], body: memoryview) -> int:
        return 0

    def max_params_nbytes(self, shape: tuple[int, ...]) -> int:
        return 0

    def codes_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return math.prod(shape) * dtype.itemsize

    def unpack(self, packed: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
        words = np.frombuffer(packed, dtype=self._WORDS[dtype.itemsize][0]).copy()
        return _by_token(words, _tokens(shape))

    def dequantize(
        self, params: memoryview, codes: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        import torch

        return torch.from_numpy(codes).view(dtype).reshape(shape)


@checked
@dataclass(frozen=True)
class Fp8(Quantizer):
    """FP8 with a float32 scale per tensor, or per channel (every position of ``shape[1:]``, max over tokens)."""

    format: Literal["e4m3", "e5m2"] = "e4m3"  #: torch.float8_e4m3fn or torch.float8_e5m2
    per_channel: bool = False
    _FORMATS: ClassVar[dict[str, str]] = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}  #: torch dtype names

    @property
    def spec(self) -> str:
        return f"fp8-{self.format}" + ("/channel" if self.per_channel else "")

    @property
    def fp8(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self._FORMATS[self.format])
        return dtype

    def bits(self, dtype: torch.dtype) -> int:
        return 8

    def _scales(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[1:] if self.per_channel and len(shape) >= 2 else ()

    def quantize(self, x: torch.Tensor) -> tuple[bytes, np.ndarray]:
        import torch

        shape = tuple(x.shape)
        xf = x.float()
        if x.numel() == 0:
            absmax = torch.zeros(self._scales(shape))
        else:  # (amax of abs is several times faster than aminmax along an axis on CPU)
            absmax = xf.abs().amax(dim=0) if self._scales(shape) else xf.abs().amax()
        if not bool(torch.isfinite(absmax).all()):
            raise UnencodableTensor(f"codec {self.spec}: cannot encode NaN or inf; store this chunk raw")
        top = torch.finfo(self.fp8).max
        scale = absmax / top
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero channel: any scale will do
        codes = (xf / scale).clamp_(-top, top).to(self.fp8).view(torch.uint8).numpy()
        return scale.numpy().tobytes(), _by_token(codes, _tokens(shape))

    def params_nbytes(self, shape: tuple[int, ...], body: memoryview) -> int:
        return self.max_params_nbytes(shape)

    def max_params_nbytes(self, shape: tuple[int, ...]) -> int:
        return 4 * math.prod(self._scales(shape))

    def codes_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return math.prod(shape)

    def unpack(self, packed: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
        return _by_token(np.frombuffer(packed, dtype=np.uint8).copy(), _tokens(shape))

    def dequantize(
        self, params: memoryview, codes: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        import torch

        scale = torch.from_numpy(np.frombuffer(params, dtype="<f4").copy()).reshape(self._scales(shape))
        values = torch.from_numpy(np.take(_fp8_values(self.fp8), codes)).reshape(shape)
        return (values * scale).to(dtype)


@cache
def _fp8_values(dtype: torch.dtype) -> np.ndarray:
    """Every fp8 code's float32 value: a table lookup decodes fp8 several times faster than torch's cast on CPU."""
    import torch

    return torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy()


@checked
@dataclass(frozen=True)
class Int4(Quantizer):
    """Asymmetric 4-bit group quantization along the last axis: per group a ``min`` and a ``step``."""

    group: Annotated[int, Meta(ge=2, le=4096, multiple_of=2, description="an even int from 2 to 4096")] = DEFAULT_GROUP

    @property
    def spec(self) -> str:
        return "int4" if self.group == DEFAULT_GROUP else f"int4:g{self.group}"

    def bits(self, dtype: torch.dtype) -> int:
        return 4

    def _groups(self, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
        """``(rows, head dim, groups per row, group size)``: a row is one token's head vector (the last axis), and a
        group never spans two rows: a head dim below the group size is one group (rounded up to an even size)."""
        d = shape[-1]
        size = min(self.group, d + d % 2)
        return math.prod(shape[:-1]), d, -(-d // size) if d else 0, size

    def quantize(self, x: torch.Tensor) -> tuple[bytes, np.ndarray]:
        import torch

        shape = tuple(x.shape)
        rows, d, groups, g = self._groups(shape)
        xr = x.reshape(rows, d).float()
        if groups * g != d:  # pad every row with copies of its last value: min and max stay the group's own
            xr = torch.cat([xr, xr[:, -1:].expand(rows, groups * g - d)], dim=1)
        xg = xr.view(rows, groups, g)
        if rows * groups:
            lo, hi = xg.amin(dim=-1), xg.amax(dim=-1)  # [rows, groups]; faster than aminmax on CPU
            if not bool(torch.isfinite(hi - lo).all()):
                finite = bool(torch.isfinite(lo).all() and torch.isfinite(hi).all())
                what = "a group spans more than float32's range" if finite else "cannot encode NaN or inf"
                raise UnencodableTensor(f"codec {self.spec}: {what}; store this chunk raw")
            wide = max(-float(lo.min()), float(hi.max())) >= _FP16_SAFE
        else:
            lo = hi = torch.zeros(rows, groups)
            wide = False
        if wide:
            low, step = lo, (hi - lo) / 15
        else:  # to float16, min rounded down and step up (by an ulp, 2**-10 relative, and a subnormal's half)
            low = (lo - lo.abs() * 2.0**-10 - 2.0**-25).to(torch.float16)
            span = (hi - low.float()) / 15
            step = (span * (1 + 2.0**-10) + 2.0**-25).to(torch.float16)
        lo_f, step_f = low.float().unsqueeze(-1), step.float().unsqueeze(-1)
        inverse = torch.where(step_f > 0, 1 / step_f, torch.zeros_like(step_f))  # step 0: every value is min
        codes = ((xg - lo_f) * inverse).round_().clamp_(0, 15).numpy().astype(np.uint8)  # numpy casts faster
        params = b"".join((bytes([low.dtype.itemsize]), low.numpy().tobytes(), step.numpy().tobytes()))
        return params, _by_token(codes, _tokens(shape))

    def pack(self, codes: np.ndarray) -> np.ndarray:
        pairs = codes.reshape(-1).view("<u2")  # always an even count: groups are even; first value in the low byte
        return ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).astype(np.uint8)

    def params_nbytes(self, shape: tuple[int, ...], body: memoryview) -> int:
        rows, _, groups, _ = self._groups(shape)
        if len(body) < 1 or body[0] not in (2, 4):
            raise UndecodableChunk(f"int4 chunk: bad parameter width {body[0] if len(body) else 'missing'}")
        return 1 + 2 * rows * groups * body[0]

    def max_params_nbytes(self, shape: tuple[int, ...]) -> int:
        rows, _, groups, _ = self._groups(shape)
        return 1 + 8 * rows * groups

    def codes_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        rows, _, groups, size = self._groups(shape)
        return rows * groups * size // 2

    def unpack(self, packed: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
        pairs = np.frombuffer(packed, dtype=np.uint8).astype("<u2")
        codes = ((pairs & 0x0F) | ((pairs & 0xF0) << 4)).view(np.uint8)  # low nibble first, as packed
        return _by_token(codes, _tokens(shape))

    def dequantize(
        self, params: memoryview, codes: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        import torch

        rows, d, groups, size = self._groups(shape)
        width = params[0]
        count = rows * groups
        np_dtype = "<f2" if width == 2 else "<f4"
        low = np.frombuffer(params, dtype=np_dtype, count=count, offset=1)
        step = np.frombuffer(params, dtype=np_dtype, count=count, offset=1 + count * width)
        lo_f = torch.from_numpy(low.astype(np.float32)).view(rows, groups, 1)
        step_f = torch.from_numpy(step.astype(np.float32)).view(rows, groups, 1)
        values = torch.from_numpy(codes).view(rows, groups, size).float() * step_f + lo_f
        return values.view(rows, groups * size)[:, :d].reshape(shape).to(dtype)
