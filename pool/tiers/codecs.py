"""KV chunk codecs: how one chunk tensor becomes the bytes a tier stores, and back.

A codec is named by a spec: a base quantizer, then optional stages, joined by ``+``::

    raw | fp8-e4m3[/channel] | fp8-e5m2[/channel] | int4[:gN]        then nothing, +zstd, or +delta+zstd

- ``raw``: the tensor's own bytes.  Lossless.
- ``fp8-e4m3``, ``fp8-e5m2``: ``x / scale`` cast to ``torch.float8_e4m3fn`` / ``float8_e5m2`` (one byte a value),
  ``scale = max|x| / 448`` (e4m3) or ``/ 57344`` (e5m2), a float32 per tensor (the default) or, with ``/channel``,
  per channel: one scale for every position of ``shape[1:]`` (layer, K or V, head, head-dim channel), the max taken
  over the tokens.  Error per value: at most ``2**-4 |x|`` (e4m3; ``2**-3`` for e5m2) plus a subnormal floor of
  ``2**-10 scale`` (``2**-17`` for e5m2).
- ``int4``: asymmetric group quantization along the last axis (the head dim): every ``N`` consecutive values of one
  token's head (default 32, ``int4:g64`` for 64; an even number from 2 to 4096; a head dim below ``N`` is one group)
  share a ``min`` and a ``step = (max - min) / 15`` and are stored as 4-bit codes ``round((x - min) / step)``, two
  to a byte (the first value in the low nibble).  ``min`` is rounded down and ``step`` up to float16, so
  ``[min, min + 15 step]`` still covers the group: the error is at most half a step, and a step is at most
  ``(max - min + 2**-9 |min|) / 15`` (float16 rounding).  Parameters are float32
  instead when a value's magnitude reaches 60000 (float16's range ends at 65504).  A head dim that ``N`` does not
  divide is padded, per token, with copies of its last value (which leave ``min`` and ``max`` alone); the padding is
  dropped on decode.  With float16 parameters and ``N = 32`` that is 5 bits a value.  Asymmetric rather than
  symmetric because a group of K is often all on one side of zero: 16 levels over ``[min, max]`` instead of 15 over
  ``[-max|x|, max|x|]``, for one more float16 per group.
- ``+zstd``: the whole body (parameters and codes) compressed by zstd (level 1, with zstd's content checksum, so a
  corrupt frame is caught); multi-byte code words (raw's) are split into byte planes first, which zstd compresses
  about 6 % better.  Lossless over the codec below it; ``zstd`` alone means ``raw+zstd``.
- ``+delta+zstd`` (int4 only): CacheGen-style: before zstd, each token's 4-bit codes are replaced by their
  difference (modulo 16) from the previous token's, since neighbouring tokens' KV is alike.  Lossless over int4.
  Measured on SmolLM2-135M's KV (``bench/codecs.py``) it makes ``int4+zstd`` 3-5 % smaller, while on raw and fp8
  codes it makes zstd's output 1-5 % larger, so ``raw+delta+zstd`` and ``fp8-*+delta+zstd`` are refused.

A chunk tensor is token-major, ``[T, ..., H, D]``: axis 0 is the tokens (every pool layout is, see
``prefill_decode/layout.py``), the last axis the head dim.  Per-channel scales and the delta stage rely on that; a
one-axis tensor is one token.  Codecs take float16, bfloat16 and float32 tensors; decode returns the input's dtype
and shape.

Encoded bytes describe themselves (integers little-endian)::

    b"KVC\\x01" | u8 n | codec name (n ASCII bytes) | u8 dtype | u8 ndim | u64 x ndim shape | u64 body length | body
    body, before zstd = parameters (scales; int4: a u8 float width, then min[], step[]) | codes

so :func:`decode` needs nothing but the bytes.  Bytes that are not such a chunk (truncated, foreign, a corrupt zstd
frame, sizes that disagree with the header) raise :class:`~kvpool.errors.UndecodableChunk`, a cache miss; a flipped
bit in an uncompressed body is not detected here: the pool's checksum of the stored bytes is what catches that.

The codec is part of a stored object's identity: :func:`codec_key` derives the key of a chunk stored with a codec
from its plain key (``raw`` keeps the plain key, so nothing stored before codecs existed changes name).
"""

import hashlib
import math
import struct
import threading
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np
import torch
import zstandard

from kvpool.errors import ConfigError, UndecodableChunk, UnencodableTensor

MAGIC = b"KVC\x01"  # format version 1
DEFAULT_GROUP = 32
ZSTD_LEVEL = 1  # levels 3 and 6 gain under 0.5 % on KV, at half and a quarter of the speed
MAX_NDIM = 16
DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_CODE = {dtype: i + 1 for i, dtype in enumerate(DTYPES)}
_DTYPE_NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPES}
_KEY_BYTES = hashlib.sha256().digest_size  # chunk keys are SHA-256 digests (pool/keys.py)
_FP16_SAFE = 60000.0  # int4 parameters are float16 while every |x| is below this
_GRAMMAR = "raw | fp8-e4m3[/channel] | fp8-e5m2[/channel] | int4[:gN], then nothing, +zstd or +delta+zstd"

Buffer = bytes | bytearray | memoryview


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
    _WORDS: ClassVar[dict[int, tuple[str, torch.dtype]]] = {2: ("<i2", torch.int16), 4: ("<i4", torch.int32)}

    @property
    def spec(self) -> str:
        return "raw"

    def bits(self, dtype: torch.dtype) -> int:
        return dtype.itemsize * 8

    def quantize(self, x: torch.Tensor) -> tuple[bytes, np.ndarray]:
        words = x.view(self._WORDS[x.dtype.itemsize][1]).numpy()
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
        return torch.from_numpy(codes).view(dtype).reshape(shape)


@dataclass(frozen=True)
class Fp8(Quantizer):
    """FP8 with a float32 scale per tensor, or per channel (every position of ``shape[1:]``, max over tokens)."""

    format: str = "e4m3"  #: "e4m3" (torch.float8_e4m3fn) or "e5m2" (torch.float8_e5m2)
    per_channel: bool = False
    _FORMATS: ClassVar[dict[str, torch.dtype]] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

    def __post_init__(self) -> None:
        if self.format not in self._FORMATS:
            raise ConfigError(f"fp8 format must be one of {', '.join(self._FORMATS)}, got {self.format!r}")

    @property
    def spec(self) -> str:
        return f"fp8-{self.format}" + ("/channel" if self.per_channel else "")

    @property
    def fp8(self) -> torch.dtype:
        return self._FORMATS[self.format]

    def bits(self, dtype: torch.dtype) -> int:
        return 8

    def _scales(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[1:] if self.per_channel and len(shape) >= 2 else ()

    def quantize(self, x: torch.Tensor) -> tuple[bytes, np.ndarray]:
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
        scale = torch.from_numpy(np.frombuffer(params, dtype="<f4").copy()).reshape(self._scales(shape))
        values = torch.from_numpy(np.take(_FP8_VALUES[self.format], codes)).reshape(shape)
        return (values * scale).to(dtype)


#: every fp8 code's float32 value: a table lookup decodes fp8 several times faster than torch's cast on CPU
_FP8_VALUES = {
    name: torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy() for name, dtype in Fp8._FORMATS.items()
}


@dataclass(frozen=True)
class Int4(Quantizer):
    """Asymmetric 4-bit group quantization along the last axis: per group a ``min`` and a ``step``."""

    group: int = DEFAULT_GROUP

    def __post_init__(self) -> None:
        g = self.group
        if not isinstance(g, int) or isinstance(g, bool) or not 2 <= g <= 4096 or g % 2:
            raise ConfigError(f"int4 group size must be an even int from 2 to 4096, got {g!r}")

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


@dataclass(frozen=True)
class ChunkHeader:
    """What the front of an encoded chunk says."""

    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    body_offset: int  #: where the body starts in the encoded bytes
    body_length: int


@dataclass(frozen=True)
class Codec:
    """A quantizer and its lossless stages; build one with :func:`parse_codec`.

    ``encode`` and ``decode`` may be called from several threads at once.
    """

    quantizer: Quantizer
    delta: bool = False  #: token-wise delta of the code words before zstd (needs ``zstd``)
    zstd: bool = False

    def __post_init__(self) -> None:
        if self.delta and not self.zstd:
            raise ConfigError("the delta stage only helps the zstd stage after it: use +delta+zstd")
        if self.delta and not isinstance(self.quantizer, Int4):
            raise ConfigError(
                f"+delta+zstd is an int4 stage: on {self.quantizer.spec} KV it compresses worse than plain +zstd "
                "(measured by bench/codecs.py); use +zstd"
            )

    @property
    def name(self) -> str:
        """The canonical spec: ``parse_codec(c.name) == c``; part of a stored chunk's identity."""
        return self.quantizer.spec + ("+delta" if self.delta else "") + ("+zstd" if self.zstd else "")

    @property
    def lossless(self) -> bool:
        return self.quantizer.lossless

    def __str__(self) -> str:
        return self.name

    def encode(self, tensor: torch.Tensor) -> bytes:
        """The self-describing bytes of one chunk tensor (float16, bfloat16 or float32, at least one axis)."""
        x = _checked(tensor, self.name)
        q = self.quantizer
        params, codes = q.quantize(x)
        if self.delta:
            codes = _delta(codes, q.bits(x.dtype))
        packed = q.pack(codes).reshape(-1)
        if self.zstd and packed.itemsize > 1:
            packed = _to_planes(packed)
        parts: list[bytes | memoryview] = [params, packed.view(np.uint8).data]
        if self.zstd:
            parts = [_compress(b"".join(parts))]
        name = self.name.encode("ascii")
        shape = tuple(x.shape)
        length = sum(len(p) for p in parts)
        layout = f"<4sB{len(name)}sBB{len(shape)}QQ"
        head = struct.pack(layout, MAGIC, len(name), name, _DTYPE_CODE[x.dtype], len(shape), *shape, length)
        return b"".join((head, *parts))

    def decode(self, data: Buffer) -> torch.Tensor:
        """The tensor back (a new CPU tensor, the encoded dtype and shape).  Raises ``UndecodableChunk`` for
        bytes that are not a chunk encoded by this codec."""
        header = read_header(data)
        if header.codec != self.name:
            raise UndecodableChunk(f"chunk was encoded with codec {header.codec!r}, not {self.name!r}")
        view = memoryview(data).cast("B")
        body = view[header.body_offset :]
        q, shape, dtype = self.quantizer, header.shape, header.dtype
        if self.zstd:
            body = memoryview(_decompress(body, q.max_params_nbytes(shape) + q.codes_nbytes(shape, dtype)))
        n_params = q.params_nbytes(shape, body)
        if len(body) != n_params + q.codes_nbytes(shape, dtype):
            raise UndecodableChunk(
                f"{self.name} chunk of shape {list(shape)}: body is {len(body)} bytes, expected "
                f"{n_params + q.codes_nbytes(shape, dtype)}"
            )
        packed = body[n_params:]
        if self.zstd and q.bits(dtype) > 8:
            packed = _from_planes(packed, q.bits(dtype) // 8)
        codes = q.unpack(packed, shape, dtype)
        if self.delta:
            codes = _undelta(codes, q.bits(dtype))
        return q.dequantize(body[:n_params], codes, shape, dtype)


@dataclass(frozen=True)
class TensorFormat:
    """The dtype and shape of a chunk the pool holds as plain bytes: what a tier's codec needs to encode it.

    A chunk put as a tensor carries its format; one put as bytes has none and is stored raw on every tier.
    """

    dtype: str  #: "float16", "bfloat16" or "float32"
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_NAMES:
            raise ConfigError(f"tensor format: dtype must be one of {sorted(_DTYPE_NAMES)}, got {self.dtype!r:.40}")
        if not (
            isinstance(self.shape, tuple)
            and 1 <= len(self.shape) <= MAX_NDIM
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.shape)
        ):
            raise ConfigError(f"tensor format: shape must be 1 to {MAX_NDIM} ints > 0, got {self.shape!r:.80}")

    @classmethod
    def of(cls, data: object) -> "TensorFormat | None":
        """The format of a CPU tensor a codec can encode; None for anything else (bytes, arrays, int tensors)."""
        if not isinstance(data, torch.Tensor) or data.dtype not in _DTYPE_CODE or data.dim() == 0:
            return None
        return cls(str(data.dtype).removeprefix("torch."), tuple(data.shape))

    @classmethod
    def of_encoded(cls, data: Buffer) -> "TensorFormat":
        """The format of the chunk that encoded bytes hold (from their header; ``UndecodableChunk`` if none)."""
        header = read_header(data)
        return cls(str(header.dtype).removeprefix("torch."), header.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPE_NAMES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def view(self, data: Buffer) -> torch.Tensor:
        """The bytes as a tensor of this format (no copy)."""
        view = memoryview(data).cast("B")
        if view.nbytes != self.nbytes:
            raise UndecodableChunk(f"{view.nbytes} bytes are not a {self.dtype} tensor of shape {list(self.shape)}")
        with warnings.catch_warnings():  # read-only bytes: the tensor is only read (encoded)
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.uint8).view(self.torch_dtype).view(self.shape)


def transcode(data: Buffer, source: str, target: str, fmt: TensorFormat | None) -> tuple[Buffer, TensorFormat | None]:
    """Chunk bytes stored with codec ``source`` re-stored with codec ``target``, and the chunk's format.

    ``raw`` means the plain bytes (no header).  A chunk with no format (put as bytes) only goes raw → raw;
    a coded chunk knows its format from its header.  ``data`` is returned as it is when nothing changes.
    """
    if source == target:
        return data, fmt
    tensor = decode(data) if source != "raw" else (fmt.view(data) if fmt is not None else None)
    if tensor is None:
        raise UnencodableTensor(f"chunk stored as plain bytes (no tensor format) cannot be encoded with {target}")
    fmt = TensorFormat.of(tensor)
    if target == "raw":
        return tensor.contiguous().view(torch.uint8).numpy().tobytes(), fmt
    return parse_codec(target).encode(tensor), fmt


def parse_codec(spec: str) -> Codec:
    """The codec a spec names (see the module docstring for the grammar); ``ConfigError`` if it names none.

    Specs are case-insensitive and canonicalised: ``parse_codec("int4:g32").name == "int4"``.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"codec spec must be a string, got {type(spec).__name__}")
    return _parse(spec.strip().lower())


@lru_cache(maxsize=256)
def _parse(spec: str) -> Codec:
    base, *stages = spec.split("+")
    if base == "zstd":
        base, stages = "raw", ["zstd", *stages]
    if stages not in ([], ["zstd"], ["delta", "zstd"]):
        raise ConfigError(f"codec spec {spec!r}: stages must be nothing, +zstd or +delta+zstd ({_GRAMMAR})")
    quantizer: Quantizer
    if base == "raw":
        quantizer = Raw()
    elif base.startswith("fp8-"):
        fmt, _, scope = base.removeprefix("fp8-").partition("/")
        if fmt not in ("e4m3", "e5m2") or scope not in ("", "tensor", "channel"):
            raise ConfigError(f"codec spec {spec!r}: fp8 is fp8-e4m3 or fp8-e5m2, then /tensor or /channel")
        quantizer = Fp8(fmt, per_channel=scope == "channel")
    elif base == "int4" or base.startswith("int4:"):
        option = base.removeprefix("int4").removeprefix(":")
        group = DEFAULT_GROUP
        if option:
            if not option.startswith("g") or not option[1:].isdigit():
                raise ConfigError(f"codec spec {spec!r}: int4 takes a group size as int4:gN, e.g. int4:g64")
            group = int(option[1:])
        quantizer = Int4(group)
    else:
        raise ConfigError(f"unknown codec spec {spec!r}; expected {_GRAMMAR}")
    return Codec(quantizer, delta="delta" in stages, zstd="zstd" in stages)


def read_header(data: Buffer) -> ChunkHeader:
    """The header of encoded chunk bytes; ``UndecodableChunk`` if they do not start with one, or if the body
    length it announces is not what follows."""
    view = memoryview(data).cast("B")
    reader = _Reader(view)
    if reader.take(4) != MAGIC:
        raise UndecodableChunk("not an encoded KV chunk (bad magic or format version)")
    try:
        name = reader.take(reader.byte()).decode("ascii")
    except UnicodeDecodeError:
        raise UndecodableChunk("encoded chunk: codec name is not ASCII") from None
    code, ndim = reader.byte(), reader.byte()
    if not 1 <= code <= len(DTYPES):
        raise UndecodableChunk(f"encoded chunk: unknown dtype code {code}")
    if not 1 <= ndim <= MAX_NDIM:
        raise UndecodableChunk(f"encoded chunk: {ndim} dimensions (1 to {MAX_NDIM} are possible)")
    shape = struct.unpack(f"<{ndim}Q", reader.take(8 * ndim))
    (length,) = struct.unpack("<Q", reader.take(8))
    if length != len(view) - reader.pos:
        raise UndecodableChunk(f"encoded chunk announces a {length}-byte body, {len(view) - reader.pos} follow")
    return ChunkHeader(name, DTYPES[code - 1], shape, reader.pos, length)


def decode(data: Buffer) -> torch.Tensor:
    """Decode chunk bytes with whichever codec their header names."""
    name = read_header(data).codec
    try:
        codec = parse_codec(name)
    except ConfigError as exc:
        raise UndecodableChunk(f"encoded chunk names a codec this version cannot decode: {exc}") from None
    return codec.decode(data)


def codec_key(chunk_key: bytes, codec: Codec | str) -> bytes:
    """The key of a chunk stored with ``codec``: ``SHA-256(key || "codec" || name)``, or ``key`` itself for raw.

    Apply it last: ``codec_key(layer_key(k, l), codec)``; chunks of different codecs never share a key, and raw
    chunks keep the keys they always had.
    """
    if not isinstance(chunk_key, bytes) or len(chunk_key) != _KEY_BYTES:
        got = f"{len(chunk_key)} bytes" if isinstance(chunk_key, bytes) else type(chunk_key).__name__
        raise ConfigError(f"chunk_key: a chunk key is a {_KEY_BYTES}-byte SHA-256 digest (pool/keys.py), got {got}")
    name = codec.name if isinstance(codec, Codec) else parse_codec(codec).name
    if name == "raw":
        return chunk_key
    return hashlib.sha256(chunk_key + b"codec" + name.encode("ascii")).digest()


class _Reader:
    """Sequential reads from a byte view; running past its end is ``UndecodableChunk``, not an IndexError."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.view):
            raise UndecodableChunk(
                f"encoded chunk truncated: header needs {self.pos + n} bytes, {len(self.view)} given"
            )
        self.pos += n
        return bytes(self.view[self.pos - n : self.pos])

    def byte(self) -> int:
        return self.take(1)[0]


def _checked(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise UnencodableTensor(f"codec {codec} encodes torch tensors, got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPE_CODE:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise UnencodableTensor(
            f"codec {codec} encodes {names} tensors, got {str(tensor.dtype).removeprefix('torch.')}"
        )
    if not 1 <= tensor.ndim <= MAX_NDIM:
        raise UnencodableTensor(f"codec {codec} encodes tensors of 1 to {MAX_NDIM} dimensions, got {tensor.ndim}")
    return tensor.detach().cpu().contiguous()


def _delta(codes: np.ndarray, bits: int) -> np.ndarray:
    """Token-wise differences of code words ``[T, M]``, modulo ``2**bits`` (integer arithmetic wraps)."""
    out = codes.copy()
    np.subtract(codes[1:], codes[:-1], out=out[1:])
    if bits < 8:
        out &= (1 << bits) - 1
    return out


def _undelta(deltas: np.ndarray, bits: int) -> np.ndarray:
    out = np.cumsum(deltas, axis=0, dtype=deltas.dtype)
    if bits < 8:
        out &= (1 << bits) - 1
    return out


def _to_planes(words: np.ndarray) -> np.ndarray:
    """Multi-byte words as byte planes (every first byte, then every second, ...): zstd finds the runs in a float's
    sign-and-exponent byte that interleaving hides (about 6 % smaller for raw bfloat16 and float32 KV)."""
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, words.itemsize).T).reshape(-1)


def _from_planes(planes: memoryview, width: int) -> memoryview:
    if len(planes) % width:
        raise UndecodableChunk(f"byte planes of {len(planes)} bytes do not split into {width}-byte words")
    data = np.frombuffer(planes, dtype=np.uint8).reshape(width, -1)
    words = np.empty((data.shape[1], width), dtype=np.uint8)
    for i in range(width):  # a plane at a time: several times faster than one transposing copy
        words[:, i] = data[i]
    return words.reshape(-1).data


_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread


def _compress(body: bytes) -> bytes:
    cctx = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    return cctx.compress(body)


def _decompress(frame: memoryview, bound: int) -> bytes:
    """Exactly one zstd frame, which must state its content size: at most ``bound`` bytes (what the header's
    shape allows) and at most 32768 bytes per frame byte (a 4-byte zstd block holds at most 128 KiB), so corrupt
    bytes can never make it allocate more than a real chunk could need."""
    try:
        size = zstandard.frame_content_size(frame)
        if not 0 <= size <= min(bound, 32768 * len(frame)):
            raise UndecodableChunk(
                f"zstd frame of {size} bytes (-1: unknown) in a {len(frame)}-byte frame, bound {bound}"
            )
        dctx = getattr(_local, "dctx", None)
        if dctx is None:
            dctx = _local.dctx = zstandard.ZstdDecompressor()
        out = dctx.decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise UndecodableChunk(f"corrupt zstd frame: {exc}") from None
    if len(out) != size:
        raise UndecodableChunk(f"zstd frame decompressed to {len(out)} bytes, its header says {size}")
    return out
