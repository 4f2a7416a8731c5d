"""S3 requests of ``bench/remote.py``: RemoteStore and its peer, raw boto3 with the same client settings, putting
and getting chunks on threads, each request timed; the two take turns, so load from elsewhere falls on both alike."""

import contextlib
import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import boto3
import botocore.config
import numpy as np

from kvpool.bench.limits import gbps
from kvpool.pool.tiers.s3 import RemoteStore
from kvpool.pool.tiers.s3_config import RemoteConfig

KiB = 1 << 10
WARM_BYTES = 64 * KiB
ROUNDS = 4  #: turns each client takes per cell (see bench_requests)

T = TypeVar("T")

Put = Callable[[bytes, bytes], None]  #: store one chunk: (key, data)
Get = Callable[[bytes], bytes]  #: read one chunk back


# -- clients ---------------------------------------------------------------------------------------------


def client_config(config: RemoteConfig, connections: int) -> botocore.config.Config:
    """The botocore settings RemoteStore uses (pool/tiers/s3.py), for the boto3 peer."""
    return botocore.config.Config(
        connect_timeout=config.timeout_s,
        read_timeout=config.timeout_s,
        retries={"max_attempts": 2, "mode": "standard"},
        max_pool_connections=connections,
        s3={"addressing_style": "path"},
    )


def boto3_ops(client: Any, bucket: str, root: str) -> tuple[Put, Get]:
    """put_object/get_object and nothing else, objects named as RemoteStore names raw chunks."""

    def put(key: bytes, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=root + key.hex(), Body=data)

    def get(key: bytes) -> bytes:
        response = client.get_object(Bucket=bucket, Key=root + key.hex())
        with contextlib.closing(response["Body"]) as body:
            data: bytes = body.read()
        return data

    return put, get


def store_ops(store: RemoteStore) -> tuple[Put, Get]:
    return (lambda key, data: store.put(key, "raw", data)), (lambda key: store.get(key, "raw"))


def keys(tag: str, n: int) -> list[bytes]:
    """``n`` chunk keys (SHA-256 digests, as kvpool/core/keys.py makes them), distinct per ``tag``."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


# -- timing ----------------------------------------------------------------------------------------------


def timed(
    fn: Callable[[T], object], items: Sequence[T], threads: int, pool: ThreadPoolExecutor
) -> tuple[float, list[float]]:
    """``fn`` of every item on ``threads`` threads, thread ``t`` taking items ``t, t + threads, ...``: the wall
    seconds of the whole and the seconds of each call."""

    def worker(first: int) -> list[float]:
        seconds = []
        for item in items[first::threads]:
            t0 = time.perf_counter()
            fn(item)
            seconds.append(time.perf_counter() - t0)
        return seconds

    t0 = time.perf_counter()
    futures = [pool.submit(worker, t) for t in range(min(threads, len(items)))]
    latencies = [s for f in futures for s in f.result()]
    return time.perf_counter() - t0, latencies


def figures(nbytes: int, wall: float, latencies: list[float]) -> dict[str, float]:
    p50, p99 = np.percentile(latencies, [50, 99])
    return {
        "seconds": wall,
        "gbps": gbps(nbytes, wall),
        "ops_per_s": len(latencies) / wall,
        "p50_ms": float(p50) * 1e3,
        "p99_ms": float(p99) * 1e3,
    }


# -- the benchmark ---------------------------------------------------------------------------------------


def bench_requests(
    clients: dict[str, tuple[Put, Get]],
    store: RemoteStore,
    size: int,
    threads: int,
    n: int,
    run: str,
    pool: ThreadPoolExecutor,
) -> list[dict[str, Any]]:
    """Put then get ``n`` chunks of ``size`` bytes with each client; rows of figures, objects deleted after.

    Each op runs in up to ``ROUNDS`` rounds of ``n / rounds`` chunks (at least ``threads`` a round), the clients
    taking turns A B, B A, A B, ..., and each client's rounds are summed: load from elsewhere falls on both alike."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()  # incompressible
    names = list(clients)
    chunk_keys = {name: keys(f"{run}/{name}/{size}/{threads}", n) for name in names}
    rounds = max(1, min(ROUNDS, n // threads))
    bounds = [n * r // rounds for r in range(rounds + 1)]
    rows = []
    for op in ("put", "get"):
        walls, got = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        latencies: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                put, get = clients[name]
                batch = chunk_keys[name][bounds[r] : bounds[r + 1]]
                if op == "put":
                    wall, lat = timed(partial(put_one, put, data), batch, threads, pool)
                else:
                    lengths: list[int] = []
                    wall, lat = timed(partial(get_one, get, lengths), batch, threads, pool)
                    got[name] += sum(lengths)
                walls[name] += wall
                latencies[name] += lat
        for name in names:
            if op == "get" and got[name] != n * size:
                raise RuntimeError(f"{name} read {got[name]} bytes back, {n * size} were put")
            rows.append(
                {
                    "op": op,
                    "client": name,
                    "size": size,
                    "threads": threads,
                    "requests": n,
                    "bytes": n * size,
                    "rounds": rounds,
                    **figures(n * size, walls[name], latencies[name]),
                }
            )
    # the peer's objects have the names RemoteStore gives raw chunks: RemoteStore deletes them all
    store.delete([(k, "raw") for ks in chunk_keys.values() for k in ks])
    return rows


def put_one(put: Put, data: bytes, key: bytes) -> None:
    put(key, data)


def get_one(get: Get, lengths: list[int], key: bytes) -> None:
    lengths.append(len(get(key)))  # list.append is atomic: threads share ``lengths``


def peer_client(config: RemoteConfig, store: RemoteStore, connections: int) -> Any:
    """A raw boto3 S3 client for the same server, credentials and settings as ``store``."""
    session = boto3.session.Session(
        aws_access_key_id=config.access_key_id or None, aws_secret_access_key=config.secret_access_key or None
    )
    return session.client(
        "s3", endpoint_url=store.endpoint, region_name=store.region, config=client_config(config, connections)
    )


def warm_up(
    clients: dict[str, tuple[Put, Get]], store: RemoteStore, warm: list[bytes], pool: ThreadPoolExecutor
) -> None:
    """Each client puts and gets ``warm`` (small objects, all at once): connections opened, the first volume made."""
    blob = bytes(WARM_BYTES)
    for put, get in clients.values():
        timed(partial(put_one, put, blob), warm, len(warm), pool)
        timed(partial(get_one, get, []), warm, len(warm), pool)
    store.delete([(k, "raw") for k in warm])
