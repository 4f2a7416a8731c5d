"""KV through the remote tier, for ``bench/remote.py``: float32 ``torch.randn`` chunks per codec, encode+put and
get+decode on threads, the codec alone on one thread, and the relative error of a chunk read back."""

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvpool.bench.limits import gbps
from kvpool.bench.remote_requests import figures, keys, timed
from kvpool.pool.tiers.codecs import Codec, parse_codec
from kvpool.pool.tiers.s3 import RemoteStore


def kv_chunks(shape: tuple[int, int, int], count: int) -> list[torch.Tensor]:
    """``count`` float32 KV-like chunks ``[tokens, 2, heads, head_dim]``."""
    tokens, heads, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, 2, heads, head_dim, generator=gen) for _ in range(count)]


def codec_alone(codec: Codec, tensors: list[torch.Tensor]) -> tuple[float, float]:
    """One thread, no network: encode and decode GB/s of KV, each the fastest of 3 passes."""
    encoded = [codec.encode(t) for t in tensors]
    kv_bytes = sum(t.nbytes for t in tensors)
    enc = dec = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for t in tensors:
            codec.encode(t)
        enc = min(enc, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b in encoded:
            codec.decode(b)
        dec = min(dec, time.perf_counter() - t0)
    return gbps(kv_bytes, enc), gbps(kv_bytes, dec)


def bench_codec(
    store: RemoteStore,
    spec: str,
    tensors: list[torch.Tensor],
    threads: int,
    n: int,
    run: str,
    pool: ThreadPoolExecutor,
) -> dict[str, Any]:
    """Encode+put then get+decode ``n`` KV chunks (``tensors``, cycled) with ``spec``; objects deleted after."""
    codec = parse_codec(spec)
    kv_bytes = tensors[0].nbytes
    ks = keys(f"{run}/codec/{codec.name}/{threads}", n)
    stored = [0] * n

    def encode_put(i: int) -> None:
        body = codec.encode(tensors[i % len(tensors)])
        stored[i] = len(body)
        store.put(ks[i], codec.name, body)

    put_wall, put_lat = timed(encode_put, range(n), threads, pool)
    first: list[torch.Tensor] = []

    def get_decode(i: int) -> None:
        tensor = codec.decode(store.get(ks[i], codec.name))
        if i == 0:
            first.append(tensor)

    get_wall, get_lat = timed(get_decode, range(n), threads, pool)
    store.delete([(k, codec.name) for k in ks])
    original = tensors[0]
    err = float((first[0] - original).norm() / original.norm())
    if codec.lossless and err != 0:
        raise RuntimeError(f"{codec.name} is lossless but a chunk came back different (relative error {err:.2e})")
    put, get = figures(n * kv_bytes, put_wall, put_lat), figures(n * kv_bytes, get_wall, get_lat)
    return {
        "codec": codec.name,
        "threads": threads,
        "chunks": n,
        "kv_bytes": n * kv_bytes,
        "stored_bytes": sum(stored),
        "ratio": n * kv_bytes / sum(stored),
        "kv_rel_err": err,
        "put_kv_gbps": put["gbps"],
        "put_stored_gbps": gbps(sum(stored), put_wall),
        "put_p50_ms": put["p50_ms"],
        "put_p99_ms": put["p99_ms"],
        "get_kv_gbps": get["gbps"],
        "get_stored_gbps": gbps(sum(stored), get_wall),
        "get_p50_ms": get["p50_ms"],
        "get_p99_ms": get["p99_ms"],
    }


def codec_rows(
    store: RemoteStore,
    spec: str,
    kv_tensors: list[torch.Tensor],
    total: int,
    thread_counts: list[int],
    run: str,
    pool: ThreadPoolExecutor,
    step: Callable[[str], None],
) -> list[dict[str, Any]]:
    """The codec alone, then :func:`bench_codec` on ``total`` bytes of KV for each number of threads."""
    n = max(1, total // kv_tensors[0].nbytes)
    step(f"{spec}: the codec alone")
    enc, dec = codec_alone(parse_codec(spec), kv_tensors)
    rows = []
    for threads in thread_counts:
        step(f"{spec}: {n} KV chunks, {threads} thread(s): encode+put, get+decode")
        row = bench_codec(store, spec, kv_tensors, threads, n, run, pool)
        rows.append({**row, "encode_gbps": enc, "decode_gbps": dec})
    return rows
