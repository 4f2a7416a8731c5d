"""The lossless stages of a codec: token-wise deltas of code words, byte planes, and zstd frames whose size is
checked before anything is allocated."""

import threading

import numpy as np
import zstandard

from kvpool.errors import UndecodableChunk

ZSTD_LEVEL = 1  # higher levels compressed KV barely better, at a fraction of the speed (bench/codecs.py's rates)


def delta(codes: np.ndarray, bits: int) -> np.ndarray:
    """Token-wise differences of code words ``[T, M]``, modulo ``2**bits`` (integer arithmetic wraps)."""
    out = codes.copy()
    np.subtract(codes[1:], codes[:-1], out=out[1:])
    if bits < 8:
        out &= (1 << bits) - 1
    return out


def undelta(deltas: np.ndarray, bits: int) -> np.ndarray:
    out = np.cumsum(deltas, axis=0, dtype=deltas.dtype)
    if bits < 8:
        out &= (1 << bits) - 1
    return out


def to_planes(words: np.ndarray) -> np.ndarray:
    """Multi-byte words as byte planes (every first byte, then every second, ...): zstd finds the runs in a float's
    sign-and-exponent byte that interleaving hides (about 6 % smaller for raw bfloat16 and float32 KV)."""
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, words.itemsize).T).reshape(-1)


def from_planes(planes: memoryview, width: int) -> memoryview:
    if len(planes) % width:
        raise UndecodableChunk(f"byte planes of {len(planes)} bytes do not split into {width}-byte words")
    data = np.frombuffer(planes, dtype=np.uint8).reshape(width, -1)
    words = np.empty((data.shape[1], width), dtype=np.uint8)
    for i in range(width):  # a plane at a time: several times faster than one transposing copy
        words[:, i] = data[i]
    return words.reshape(-1).data


_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread


def compress(body: bytes) -> bytes:
    cctx = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    return cctx.compress(body)


def decompress(frame: memoryview, bound: int) -> bytes:
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
