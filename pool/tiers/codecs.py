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
``prefill_decode/reference/layout.py``), the last axis the head dim.  Per-channel scales and the delta stage rely on that; a
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

Encryption at rest is not a stage of a spec but a setting of the tier (``PoolConfig.encryption``,
``RemoteConfig.encryption``; see :mod:`~kvpool.pool.tiers.crypto` for why): it seals whatever the tier stores, after
this codec, and the stored codec name then ends in ``+aes256gcm`` (``codec_key`` accepts such names).

Dtypes are handled by name until a tensor is made or read, and torch is imported only there: a pool node whose
tiers store chunks raw never loads it (which saves each node process a second or more at start).
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, TypeGuard

import numpy as np
from msgspec import Meta

from kvpool.core.config import Config, Positive, validated
from kvpool.core.keys import check_key
from kvpool.errors import ConfigError, UndecodableChunk, UnencodableTensor
from kvpool.pool.tiers import crypto
from kvpool.pool.tiers.lossless import compress, decompress, delta, from_planes, to_planes, undelta
from kvpool.pool.tiers.quantizers import DEFAULT_GROUP, Fp8, Int4, Quantizer, Raw

if TYPE_CHECKING:
    import torch

MAGIC = b"KVC\x01"  # format version 1
MAX_NDIM = 16
#: the dtypes codecs take, by torch name, with their itemsize; a header's dtype code is the position here, from 1
DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(DTYPES)}
_DTYPE_NAMES = tuple(DTYPES)
_GRAMMAR = "raw | fp8-e4m3[/channel] | fp8-e5m2[/channel] | int4[:gN], then nothing, +zstd or +delta+zstd"
_SPEC = re.compile(
    r"(?P<zstd_only>zstd)|(?:raw|fp8-(?P<fp8>e4m3|e5m2)(?:/(?P<scope>tensor|channel))?|(?P<int4>int4)(?::g(?P<group>\d+))?)"
    r"(?P<stages>\+zstd|\+delta\+zstd)?",
    re.ASCII,
)
_SpecText = Annotated[str, Meta(description=f"a string ({_GRAMMAR})")]

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class ChunkHeader:
    """What the front of an encoded chunk says."""

    codec: str
    dtype: str  #: a name in ``DTYPES``
    shape: tuple[int, ...]
    body_offset: int  #: where the body starts in the encoded bytes
    body_length: int


@dataclass(frozen=True)
class Codec:
    """A quantizer and its lossless stages; build one with :func:`parse_codec`.

    ``encode`` and ``decode`` may be called from several threads at once.
    """

    quantizer: Quantizer
    delta: bool = False  #: token-wise delta of int4 code words before zstd (needs both)
    zstd: bool = False

    def __post_init__(self) -> None:
        if self.delta and not (self.zstd and isinstance(self.quantizer, Int4)):
            raise ConfigError(
                f"the delta stage goes between int4 and zstd (int4+delta+zstd): it only helps the zstd stage after it, "
                f"and on {self.quantizer.spec} KV it compresses worse than plain +zstd (measured by bench/codecs.py)"
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
            codes = delta(codes, q.bits(x.dtype))
        packed = q.pack(codes).reshape(-1)
        if self.zstd and packed.itemsize > 1:
            packed = to_planes(packed)
        parts: list[bytes | memoryview] = [params, packed.view(np.uint8).data]
        if self.zstd:
            parts = [compress(b"".join(parts))]
        name = self.name.encode("ascii")
        shape = tuple(x.shape)
        length = sum(len(p) for p in parts)
        layout = f"<4sB{len(name)}sBB{len(shape)}QQ"
        code = _DTYPE_CODE[_dtype_name(x)]
        head = struct.pack(layout, MAGIC, len(name), name, code, len(shape), *shape, length)
        return b"".join((head, *parts))

    def decode(self, data: Buffer) -> torch.Tensor:
        """The tensor back (a new CPU tensor, the encoded dtype and shape).  Raises ``UndecodableChunk`` for
        bytes that are not a chunk encoded by this codec."""
        header = read_header(data)
        if header.codec != self.name:
            raise UndecodableChunk(f"chunk was encoded with codec {header.codec!r}, not {self.name!r}")
        view = memoryview(data).cast("B")
        body = view[header.body_offset :]
        q, shape, dtype = self.quantizer, header.shape, _torch_dtype(header.dtype)
        if self.zstd:
            body = memoryview(decompress(body, q.max_params_nbytes(shape) + q.codes_nbytes(shape, dtype)))
        n_params = q.params_nbytes(shape, body)
        if len(body) != n_params + q.codes_nbytes(shape, dtype):
            raise UndecodableChunk(
                f"{self.name} chunk of shape {list(shape)}: body is {len(body)} bytes, expected "
                f"{n_params + q.codes_nbytes(shape, dtype)}"
            )
        packed = body[n_params:]
        if self.zstd and q.bits(dtype) > 8:
            packed = from_planes(packed, q.bits(dtype) // 8)
        codes = q.unpack(packed, shape, dtype)
        if self.delta:
            codes = undelta(codes, q.bits(dtype))
        return q.dequantize(body[:n_params], codes, shape, dtype)


class TensorFormat(Config, frozen=True):
    """The dtype and shape of a chunk the pool holds as plain bytes: what a tier's codec needs to encode it.

    A chunk put as a tensor carries its format; one put as bytes has none and is stored raw on every tier.
    """

    dtype: Annotated[str, Meta(pattern=f"^({'|'.join(DTYPES)})\\Z", description=f"one of {', '.join(DTYPES)}")]
    shape: Annotated[
        tuple[Positive, ...], Meta(min_length=1, max_length=MAX_NDIM, description=f"1 to {MAX_NDIM} ints > 0")
    ]

    @classmethod
    def of(cls, data: object) -> TensorFormat | None:
        """The format of a CPU tensor a codec can encode; None for anything else (bytes, arrays, int tensors)."""
        if not _is_tensor(data) or _dtype_name(data) not in DTYPES or data.dim() == 0:
            return None
        return cls(_dtype_name(data), tuple(data.shape))

    @classmethod
    def of_pieces(cls, data: object) -> TensorFormat | None:
        """:meth:`of` of a chunk given as one tensor, or as a list of tensors of one dtype and one shape but their
        first dimension (runs of blocks): the format of their concatenation along it."""
        if not isinstance(data, (list, tuple)):
            return cls.of(data)
        known = [f for p in data if (f := cls.of(p)) is not None]
        if not known or len(known) != len(data) or len({(f.dtype, f.shape[1:]) for f in known}) != 1:
            return None
        return cls(known[0].dtype, (sum(f.shape[0] for f in known), *known[0].shape[1:]))

    @classmethod
    def of_encoded(cls, data: Buffer) -> TensorFormat:
        """The format of the chunk that encoded bytes hold (from their header; ``UndecodableChunk`` if none)."""
        header = read_header(data)
        return cls(header.dtype, header.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype]

    def view(self, data: Buffer) -> torch.Tensor:
        """The bytes as a tensor of this format (no copy)."""
        view = memoryview(data).cast("B")
        if view.nbytes != self.nbytes:
            raise UndecodableChunk(f"{view.nbytes} bytes are not a {self.dtype} tensor of shape {list(self.shape)}")
        import torch

        with warnings.catch_warnings():  # read-only bytes: the tensor is only read (encoded)
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.uint8).view(_torch_dtype(self.dtype)).view(self.shape)


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
        import torch

        return tensor.contiguous().view(torch.uint8).numpy().tobytes(), fmt
    return parse_codec(target).encode(tensor), fmt


def parse_codec(spec: str) -> Codec:
    """The codec a spec names (see the module docstring for the grammar); ``ConfigError`` if it names none.

    Specs are case-insensitive and canonicalised: ``parse_codec("int4:g32").name == "int4"``.
    """
    if not isinstance(spec, str):  # per chunk: msgspec only when it is to say what is wrong
        validated(_SpecText, spec, "codec spec")
    return _parse(spec.strip().lower())


@lru_cache(maxsize=256)
def _parse(spec: str) -> Codec:
    if crypto.STAGE.removeprefix("+") in spec.split("+"):
        raise ConfigError(
            f"codec spec {spec!r}: encryption is not a codec stage; set the tier's encryption (PoolConfig.encryption "
            "for NVMe, RemoteConfig.encryption for S3), which seals every chunk there, bytes or tensors"
        )
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise ConfigError(f"unknown codec spec {spec!r}; expected {_GRAMMAR}")
    stages = (m["stages"] or "") + ("+zstd" if m["zstd_only"] else "")
    quantizer: Quantizer = Raw()
    if m["fp8"]:
        quantizer = Fp8(m["fp8"], per_channel=m["scope"] == "channel")  # type: ignore[arg-type]  # e4m3 or e5m2
    elif m["int4"]:
        quantizer = Int4(int(m["group"]) if m["group"] else DEFAULT_GROUP)
    return Codec(quantizer, delta="delta" in stages, zstd="zstd" in stages)


def read_header(data: Buffer) -> ChunkHeader:
    """The header of encoded chunk bytes; ``UndecodableChunk`` if they do not start with one, or if the body
    length it announces is not what follows."""
    view = memoryview(data).cast("B")
    reader = _Reader(view)
    magic = reader.take(4)
    if magic != MAGIC:
        sealed = " but sealed bytes: open them first (pool/tiers/crypto.py)" if magic == crypto.MAGIC else ""
        raise UndecodableChunk(f"not an encoded KV chunk (bad magic or format version){sealed}")
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
    return ChunkHeader(name, _DTYPE_NAMES[code - 1], shape, reader.pos, length)


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
    chunks keep the keys they always had.  A sealed codec name (``...+aes256gcm``) is another codec: its own key.
    """
    check_key(chunk_key, "chunk_key")
    if isinstance(codec, Codec):
        name = codec.name
    else:
        inner, sealed = crypto.split(codec) if isinstance(codec, str) else (codec, False)
        name = parse_codec(inner).name + (crypto.STAGE if sealed else "")
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


def _is_tensor(data: object) -> TypeGuard[torch.Tensor]:
    """Whether ``data`` is a torch tensor, without importing torch: a process that has not loaded it holds none."""
    module = sys.modules.get("torch")
    return module is not None and isinstance(data, module.Tensor)


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a name in ``DTYPES`` stands for (imports torch)."""
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


def _checked(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    if not _is_tensor(tensor):
        raise UnencodableTensor(f"codec {codec} encodes torch tensors, got {type(tensor).__name__}")
    if _dtype_name(tensor) not in DTYPES:
        raise UnencodableTensor(f"codec {codec} encodes {', '.join(DTYPES)} tensors, got {_dtype_name(tensor)}")
    if not 1 <= tensor.ndim <= MAX_NDIM:
        raise UnencodableTensor(f"codec {codec} encodes tensors of 1 to {MAX_NDIM} dimensions, got {tensor.ndim}")
    return tensor.detach().cpu().contiguous()
