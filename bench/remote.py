"""Remote (S3) tier throughput: RemoteStore put/get beside raw boto3 on the same server, and KV through codecs.

Starts its own SeaweedFS (``kvpool/servers/seaweedfs.py``: one ``weed server`` on loopback, fresh credentials, a fresh bucket),
or with ``--endpoint`` and ``--bucket`` uses that server and bucket with boto3's own credentials
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws``); there it writes only under a fresh
``kvpool-bench/<run>/`` prefix and deletes what it wrote.  Then, for each chunk size and number of client threads:

- RemoteStore (``pool/tiers/s3.py``, codec ``raw``): ``--mib-per-cell`` of chunks put, then got back, each request
  timed: GB/s (bytes of the chunks as stored), requests/s, p50 and p99 latency of one request;
- the peer, in the same run on the same server: raw boto3 ``put_object``/``get_object`` with the same client settings
  (timeouts, retries, path-style addressing, connection pool) and the same sizes, so ``vs boto3`` is RemoteStore's
  own overhead (key naming, error translation, counters).  Each cell is cut into 4 rounds in which the two take
  turns (A B, B A, A B, B A), so load from elsewhere on the machine falls on both alike;
- the limits of this machine, measured in the same run (``kvpool.bench``): one loopback TCP stream sending
  chunk-sized blocks, and one thread copying the cell's bytes (at least 64 MiB: memory to memory, not cache to
  cache; not one chunk: for 256 KiB, ``memcpy_gbps``'s two buffers were seen 256 KiB + 16 bytes apart, aliased
  modulo 4 KiB, and the copy ran at a tenth of its speed for 1 MiB).  An S3 request over loopback moves its bytes
  through at least one such socket and a few copies, on the same cores as the server.

Last, KV through the tier: float32 chunks of ``torch.randn`` shaped ``[tokens, 2, heads, head_dim]`` (``--kv-shape``,
1 MiB by default), per codec (``--codecs``): encode+put and get+decode, in GB/s of KV delivered (bytes of the
float32 tensors per second, not bytes stored), the stored ratio (KV bytes / object bytes), the codec alone on one
thread (no network), and the relative error of a chunk read back.  The ratios and errors are for random normal
values; ``bench/codecs.py`` measures them on real models' KV.  The ``raw`` codec here is ``Codec.encode``, header
included (the pool stores raw chunks without it: 50 bytes less a chunk).

Each cell is one pass over its chunks: on a shared 2-core machine every figure is noisy, so rerun before trusting a
small difference.  About a minute on 2 cores with the defaults.

    python bench/remote.py [--sizes 256,1024,4096] [--threads 1,4,8] [--mib-per-cell 64] [--codecs raw,int4+zstd]
    python bench/remote.py --endpoint http://HOST:8333 --bucket NAME     # an existing S3 server, AWS_* credentials
"""

import argparse
import contextlib
import hashlib
import json
import math
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.config
import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool.bench.limits import gbps, memcpy_gbps, socket_gbps
from kvpool.pool.config import MiB
from kvpool.pool.tiers.codecs import Codec, parse_codec
from kvpool.pool.tiers.s3 import RemoteStore
from kvpool.pool.tiers.s3_config import RemoteConfig
from kvpool.servers.seaweedfs import SeaweedServer, weed_binary

console = Console(width=170)

KiB = 1 << 10
BUCKET = "kvpool-bench"  #: the bucket made on the SeaweedFS this script starts
PREFIX = "kvpool-bench"  #: objects are <PREFIX>/<run>/<hex>, the run a fresh name
VOLUME_MIB = 1024  #: SeaweedFS volume size: large, so no volume is grown while a cell is timed
WARM_BYTES = 64 * KiB
ROUNDS = 4  #: turns each client takes per cell (see bench_requests)
MEMCPY_MIN = 64 * MiB  #: the least the memcpy limit copies (beyond the caches)

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
    """``n`` chunk keys (SHA-256 digests, as pool/keys.py makes them), distinct per ``tag``."""
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
        "seconds": wall, "gbps": gbps(nbytes, wall), "ops_per_s": len(latencies) / wall,
        "p50_ms": float(p50) * 1e3, "p99_ms": float(p99) * 1e3,
    }  # fmt: skip


# -- the benchmark ---------------------------------------------------------------------------------------


def bench_requests(
    clients: dict[str, tuple[Put, Get]], store: RemoteStore, size: int, threads: int, n: int, run: str,
    pool: ThreadPoolExecutor,
) -> list[dict[str, Any]]:  # fmt: skip
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
            rows.append({
                "op": op, "client": name, "size": size, "threads": threads, "requests": n, "bytes": n * size,
                "rounds": rounds, **figures(n * size, walls[name], latencies[name]),
            })  # fmt: skip
    # the peer's objects have the names RemoteStore gives raw chunks: RemoteStore deletes them all
    store.delete([(k, "raw") for ks in chunk_keys.values() for k in ks])
    return rows


def put_one(put: Put, data: bytes, key: bytes) -> None:
    put(key, data)


def get_one(get: Get, lengths: list[int], key: bytes) -> None:
    lengths.append(len(get(key)))  # list.append is atomic: threads share ``lengths``


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
    store: RemoteStore, spec: str, tensors: list[torch.Tensor], threads: int, n: int, run: str,
    pool: ThreadPoolExecutor,
) -> dict[str, Any]:  # fmt: skip
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
        "codec": codec.name, "threads": threads, "chunks": n, "kv_bytes": n * kv_bytes, "stored_bytes": sum(stored),
        "ratio": n * kv_bytes / sum(stored), "kv_rel_err": err,
        "put_kv_gbps": put["gbps"], "put_stored_gbps": gbps(sum(stored), put_wall), "put_p50_ms": put["p50_ms"],
        "put_p99_ms": put["p99_ms"], "get_kv_gbps": get["gbps"], "get_stored_gbps": gbps(sum(stored), get_wall),
        "get_p50_ms": get["p50_ms"], "get_p99_ms": get["p99_ms"],
    }  # fmt: skip


@contextlib.contextmanager
def s3_target(args: argparse.Namespace) -> Iterator[tuple[RemoteConfig, dict[str, Any]]]:
    """The RemoteConfig to bench (and what the server is): a SeaweedFS started here, or ``--endpoint``."""
    if args.endpoint:
        yield RemoteConfig(bucket=args.bucket, endpoint_url=args.endpoint, prefix=PREFIX), {"server": args.endpoint}
        return
    key_id, secret = SeaweedServer.generate_credentials()
    version = subprocess.run([weed_binary(), "version"], capture_output=True, text=True).stdout.split("\n")[0]
    with SeaweedServer(access_key_id=key_id, secret_access_key=secret, volume_size_limit_mb=VOLUME_MIB) as server:
        server.create_bucket(BUCKET)
        config = RemoteConfig(
            bucket=BUCKET, endpoint_url=server.endpoint_url, prefix=PREFIX, access_key_id=key_id,
            secret_access_key=secret,
        )  # fmt: skip
        yield config, {"server": f"SeaweedFS ({version.strip()}) on loopback, started here", "pid": server.pid}


def run(args: argparse.Namespace, bar: Progress) -> dict[str, Any]:
    sizes, thread_counts, codecs = args.sizes, args.threads, args.codecs
    total = args.mib_per_cell * MiB
    kv_tensors = kv_chunks(args.kv_shape, 8)
    kv_bytes = kv_tensors[0].nbytes
    tcp_sizes = sorted({*sizes, kv_bytes} if codecs else set(sizes))  # the codec table shows TCP at kv_bytes
    steps = len(tcp_sizes) + len(sizes) * len(thread_counts) + len(codecs) * (1 + len(thread_counts)) + 1
    task = bar.add_task("starting the S3 server", total=steps)

    def step(what: str) -> None:
        bar.update(task, advance=1, description=what)

    run_id = f"r{uuid.uuid4().hex[:8]}"
    with s3_target(args) as (config, server), ThreadPoolExecutor(max(thread_counts)) as pool:
        connections = max(32, max(thread_counts))
        store = RemoteStore(config, run_id, max_connections=connections)
        peer = peer_client(config, store, connections)
        clients = {"RemoteStore": store_ops(store), "boto3": boto3_ops(peer, config.bucket, store.root)}
        results: dict[str, Any] = {
            "server": {**server, "endpoint": store.endpoint, "bucket": config.bucket, "root": store.root},
            "settings": {
                "sizes": sizes, "threads": thread_counts, "bytes_per_cell": total, "codecs": codecs,
                "kv_shape": [args.kv_shape[0], 2, *args.kv_shape[1:]], "kv_chunk_bytes": kv_bytes,
                "torch_threads": torch.get_num_threads(),
            },
            "limits": {"tcp": []}, "requests": [], "codecs": [],
        }  # fmt: skip
        try:
            store.check()
            step("warm-up: connections and the bucket's first volume")
            warm_up(clients, store, keys(f"{run_id}/warm", max(thread_counts)), pool)
            results["limits"] = machine_limits(tcp_sizes, total, step)
            for size in sizes:
                n = max(1, total // size)
                for threads in thread_counts:
                    step(f"{size // KiB} KiB x {n}, {threads} thread(s): put and get, RemoteStore and boto3")
                    results["requests"] += bench_requests(clients, store, size, threads, n, run_id, pool)
            for spec in codecs:
                results["codecs"] += codec_rows(store, spec, kv_tensors, total, thread_counts, run_id, pool, step)
        finally:
            with contextlib.suppress(Exception):  # an interrupted run: leave nothing of this run in the bucket
                store.delete_names([o.name for o in store.list_objects()])
            peer.close()
            store.close()
    return results


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


def machine_limits(tcp_sizes: list[int], total: int, step: Callable[[str], None]) -> dict[str, Any]:
    """memcpy of the cell's bytes (at least ``MEMCPY_MIN``), and a loopback TCP stream in blocks of each size."""
    limits: dict[str, Any] = {"tcp": []}
    limits["memcpy_bytes"] = max(total, MEMCPY_MIN)
    limits["memcpy_gbps"] = memcpy_gbps(limits["memcpy_bytes"])
    for size in tcp_sizes:
        step(f"limits: TCP loopback in {size // KiB} KiB blocks")
        limits["tcp"].append({"size": size, "tcp_gbps": socket_gbps(max(total, 64 * MiB), size)})
    return limits


def codec_rows(
    store: RemoteStore, spec: str, kv_tensors: list[torch.Tensor], total: int, thread_counts: list[int], run: str,
    pool: ThreadPoolExecutor, step: Callable[[str], None],
) -> list[dict[str, Any]]:  # fmt: skip
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


# -- output -----------------------------------------------------------------------------------------------


def size_label(size: int) -> str:
    return f"{size // MiB} MiB" if size % MiB == 0 else f"{size // KiB} KiB"


Index = dict[tuple[str, str, int, int], dict[str, Any]]  #: request rows by (op, client, size, threads)


def render(results: dict[str, Any]) -> None:
    index = {(r["op"], r["client"], r["size"], r["threads"]): r for r in results["requests"]}
    render_requests(results, index)
    if results["codecs"]:
        render_codecs(results, index)


def render_requests(results: dict[str, Any], index: Index) -> None:
    """A table per op: RemoteStore beside boto3, a row per chunk size and number of threads."""
    tcp = {lim["size"]: lim["tcp_gbps"] for lim in results["limits"]["tcp"]}
    memcpy = results["limits"]["memcpy_gbps"]
    rows = results["requests"]
    per_cell = results["settings"]["bytes_per_cell"] // MiB
    console.print(f"[bold]S3[/]: {results['server']['server']}, {results['server']['endpoint']}")
    for op in ("put", "get"):
        table = Table(title=f"remote tier {op}: RemoteStore vs raw boto3 on the same server ({per_cell} MiB per cell)")
        cols = (
            "chunk x requests", "threads", "RemoteStore GB/s", "req/s", "p50 ms", "p99 ms", "boto3 GB/s", "req/s ",
            "p50 ms ", "p99 ms ", "vs boto3", "TCP loopback GB/s", "memcpy GB/s",
        )  # fmt: skip
        for col in cols:
            table.add_column(col, justify="left" if col == "chunk x requests" else "right")
        sizes = sorted({r["size"] for r in rows})
        for size in sizes:
            threads = sorted({r["threads"] for r in rows if r["size"] == size})
            for t in threads:
                s, b = index[(op, "RemoteStore", size, t)], index[(op, "boto3", size, t)]
                table.add_row(
                    f"{size_label(size)} x {s['requests']}", str(t),
                    f"{s['gbps']:.3f}", f"{s['ops_per_s']:.0f}", f"{s['p50_ms']:.1f}", f"{s['p99_ms']:.1f}",
                    f"{b['gbps']:.3f}", f"{b['ops_per_s']:.0f}", f"{b['p50_ms']:.1f}", f"{b['p99_ms']:.1f}",
                    f"{s['gbps'] / b['gbps'] - 1:+.0%}",
                    f"{tcp[size]:.2f}", f"{memcpy:.2f}",
                    end_section=t == threads[-1] and size != sizes[-1],
                )  # fmt: skip
        console.print(table)
    console.print(
        "GB/s: bytes of the chunks as stored per second (all threads together); req/s: requests per second; p50/p99: "
        "latency of one request (with under 100 requests in a cell, p99 is about the slowest); vs boto3: RemoteStore "
        "GB/s over boto3's, minus 1.  Limits, same run: TCP loopback = one stream sending chunk-sized blocks; "
        f"memcpy = one thread copying {results['limits']['memcpy_bytes'] // MiB} MiB."
    )


def render_codecs(results: dict[str, Any], index: Index) -> None:
    """KV through the tier: a row per codec and number of threads, beside the raw rows and the limits."""
    tcp = {lim["size"]: lim["tcp_gbps"] for lim in results["limits"]["tcp"]}
    memcpy = results["limits"]["memcpy_gbps"]
    per_cell = results["settings"]["bytes_per_cell"] // MiB
    s = results["settings"]
    kv = s["kv_chunk_bytes"]
    table = Table(
        title=f"KV through the remote tier: {size_label(kv)} float32 torch.randn chunks {s['kv_shape']}, "
        f"{per_cell} MiB of KV per cell; GB/s of KV delivered"
    )
    kv_cols = (
        "codec", "threads", "ratio", "encode+put GB/s", "p50/p99 ms", "get+decode GB/s", "p50/p99 ms ",
        "stored GB/s put / get", "codec alone enc / dec GB/s", "KV rel err",
        f"raw {size_label(kv)} put / get GB/s", "TCP / memcpy GB/s",
    )  # fmt: skip
    for col in kv_cols:
        table.add_column(col, justify="left" if col == "codec" else "right")
    codecs = list(dict.fromkeys(r["codec"] for r in results["codecs"]))
    for r in results["codecs"]:
        put, get = (
            index.get(("put", "RemoteStore", kv, r["threads"])),
            index.get(("get", "RemoteStore", kv, r["threads"])),
        )
        table.add_row(
            r["codec"], str(r["threads"]), f"{r['ratio']:.2f}x",
            f"{r['put_kv_gbps']:.3f}", f"{r['put_p50_ms']:.1f} / {r['put_p99_ms']:.1f}",
            f"{r['get_kv_gbps']:.3f}", f"{r['get_p50_ms']:.1f} / {r['get_p99_ms']:.1f}",
            f"{r['put_stored_gbps']:.3f} / {r['get_stored_gbps']:.3f}",
            f"{r['encode_gbps']:.2f} / {r['decode_gbps']:.2f}", f"{r['kv_rel_err']:.4f}",
            f"{put['gbps']:.3f} / {get['gbps']:.3f}" if put and get else "-",
            f"{tcp[kv]:.2f} / {memcpy:.2f}",
            end_section=r["threads"] == s["threads"][-1] and r["codec"] != codecs[-1],
        )  # fmt: skip
    console.print(table)
    console.print(
        "ratio: KV bytes / bytes stored (headers included); encode+put, get+decode: float32 KV bytes per second "
        "through the tier (all threads); stored GB/s: the object bytes those moved; raw put / get: the RemoteStore "
        "rows above (same chunk size and threads, no codec), the tier's speed for opaque bytes; codec alone: encode "
        "and decode on one thread, no I/O; KV rel err: ||read back - original|| / ||original|| of one chunk; TCP: "
        "the limit at this chunk size; memcpy: as above."
    )


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int_list, default="256,1024,4096", help="chunk sizes, KiB (default 256,1024,4096)")
    ap.add_argument("--threads", type=int_list, default="1,4,8", help="client threads per cell (default 1,4,8)")
    ap.add_argument("--mib-per-cell", type=int, default=64, help="bytes moved per measurement, MiB (default 64)")
    ap.add_argument(
        "--codecs", default="raw,fp8-e4m3,int4+zstd", help="codec specs (default raw,fp8-e4m3,int4+zstd); '' skips them"
    )
    ap.add_argument(
        "--kv-shape", type=int_list, default="256,8,64",
        help="tokens,heads,head_dim of one KV chunk [tokens, 2, heads, head_dim], float32 (default 256,8,64: 1 MiB)",
    )  # fmt: skip
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads of each codec call (default 1)")
    ap.add_argument("--endpoint", default="", help="an S3 endpoint to use instead of starting SeaweedFS")
    ap.add_argument("--bucket", default="", help="with --endpoint: an existing bucket (credentials: AWS_* / ~/.aws)")
    ap.add_argument("--json", default="bench/results/remote.json", help="where to write the figures")
    args = ap.parse_args()
    if bool(args.endpoint) != bool(args.bucket):
        ap.error("--endpoint and --bucket go together")
    if len(args.kv_shape) != 3:
        ap.error(f"--kv-shape is tokens,heads,head_dim, got {args.kv_shape}")
    if args.mib_per_cell < 1:
        ap.error("--mib-per-cell must be >= 1")
    args.sizes = [s * KiB for s in args.sizes]
    args.kv_shape = tuple(args.kv_shape)
    args.codecs = [parse_codec(c).name for c in args.codecs.split(",") if c.strip()]
    torch.set_num_threads(args.torch_threads)
    t0 = time.perf_counter()
    with Progress(console=console, transient=True) as bar:
        results = run(args, bar)
    results["wall_s"] = time.perf_counter() - t0
    render(results)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    console.print(f"figures written to {args.json} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
