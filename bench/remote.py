"""Remote tier (S3) throughput: RemoteStore put/get beside raw boto3 on the same server, and KV through codecs.

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
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from kvpool.bench.limits import memcpy_gbps, socket_gbps
from kvpool.bench.remote_codecs import codec_rows, kv_chunks
from kvpool.bench.remote_requests import KiB, bench_requests, boto3_ops, keys, peer_client, store_ops, warm_up
from kvpool.bench.remote_tables import console, render
from kvpool.pool.config import MiB
from kvpool.pool.tiers.codecs import parse_codec
from kvpool.pool.tiers.s3 import RemoteStore
from kvpool.pool.tiers.s3_config import RemoteConfig
from kvpool.servers.seaweedfs import SeaweedServer, weed_binary

BUCKET = "kvpool-bench"  #: the bucket made on the SeaweedFS this script starts
PREFIX = "kvpool-bench"  #: objects are <PREFIX>/<run>/<hex>, the run a fresh name
VOLUME_MIB = 1024  #: SeaweedFS volume size: large, so no volume is grown while a cell is timed
MEMCPY_MIN = 64 * MiB  #: the least the memcpy limit copies (beyond the caches)


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
            bucket=BUCKET,
            endpoint_url=server.endpoint_url,
            prefix=PREFIX,
            access_key_id=key_id,
            secret_access_key=secret,
        )
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
                "sizes": sizes,
                "threads": thread_counts,
                "bytes_per_cell": total,
                "codecs": codecs,
                "kv_shape": [args.kv_shape[0], 2, *args.kv_shape[1:]],
                "kv_chunk_bytes": kv_bytes,
                "torch_threads": torch.get_num_threads(),
            },
            "limits": {"tcp": []},
            "requests": [],
            "codecs": [],
        }
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


def machine_limits(tcp_sizes: list[int], total: int, step: Callable[[str], None]) -> dict[str, Any]:
    """memcpy of the cell's bytes (at least ``MEMCPY_MIN``), and a loopback TCP stream in blocks of each size."""
    limits: dict[str, Any] = {"tcp": []}
    limits["memcpy_bytes"] = max(total, MEMCPY_MIN)
    limits["memcpy_gbps"] = memcpy_gbps(limits["memcpy_bytes"])
    for size in tcp_sizes:
        step(f"limits: TCP loopback in {size // KiB} KiB blocks")
        limits["tcp"].append({"size": size, "tcp_gbps": socket_gbps(max(total, 64 * MiB), size)})
    return limits


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
        "--kv-shape",
        type=int_list,
        default="256,8,64",
        help="tokens,heads,head_dim of one KV chunk [tokens, 2, heads, head_dim], float32 (default 256,8,64: 1 MiB)",
    )
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
