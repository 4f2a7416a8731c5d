"""Reads while the node works: the latency of a 4 MiB get from a node that is demoting to NVMe and flushing to S3,
beside the same gets from the same node idle.

Starts its own pool (embedded etcd, a local 2-node Ray cluster, SeaweedFS on loopback as the S3 tier) with a small
DRAM segment and ``flush_after_s`` short, so that a stream of puts into the head node keeps it demoting LRU chunks
to NVMe and uploading idle NVMe chunks to S3.  A hot set of chunks stays in the head node's DRAM; it is read one key
per call by a client on the head node (same node: out of the mapped segment) and by one on the other node (a peer:
a pin call on the busy node, a NIXL READ, a release), first with nothing else going on, then while a writer on the
head node puts ``--busy-mib`` of new chunks.  The table gives p50 and p99 of each, their ratio (the goal: busy p99
at most 2x idle p99) and what the node did meanwhile (chunks demoted, flushed, dropped).

The machine's cores are shared by the writer, the node's I/O threads, SeaweedFS and the readers: on 2 cores some of
the busy p99 is plain CPU contention, which no lock design removes; ``cpu_count`` is printed beside it.

    python bench/busy.py [--size-mib 4] [--gets 200] [--busy-mib 1024] [--json bench/results/busy.json]
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

from kvpool.bench.node_client import close_clients, node_clients
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig, Watermarks
from kvpool.pool.keys import CacheIdentity, chunk_keys
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.tiers.s3_config import RemoteConfig
from kvpool.servers.etcd import EmbeddedEtcd
from kvpool.servers.ray_cluster import LocalRayCluster
from kvpool.servers.seaweedfs import SeaweedServer

IDENT = CacheIdentity(model="bench-busy", kv_dtype="uint8", layout="bytes", chunk_size=1)
HOT = 8  #: chunks read over and over (they stay in DRAM: the most recently used)
DRAM_MIB, NVME_MIB = 256, 512


def p50_p99(samples: list[float]) -> tuple[float, float]:
    """Median and 99th percentile, in milliseconds."""
    return statistics.median(samples) * 1e3, statistics.quantiles(samples, n=100)[98] * 1e3


def counters(client: PoolClient, node: str) -> dict[str, int]:
    stats = client.stats()["nodes"][node]
    return {k: int(stats[k]) for k in ("migrations", "flushed", "flushed_bytes", "drops", "promotions")}


def readers(here: Any, peer: Any, keys: list[bytes], size: int, gets: int) -> dict[str, list[float]]:
    """Latencies of ``gets`` single-key gets by each reader, both reading at once."""
    got = ray.get([here.latencies.remote(keys, size, gets), peer.latencies.remote(keys, size, gets)])
    return {"same node": got[0], "from a peer": got[1]}


def measure(config: PoolConfig, head: str, second: str, size: int, gets: int, busy_bytes: int) -> dict[str, Any]:
    here, peer, writer = node_clients(config, [head, second, head])
    try:
        hot = chunk_keys(IDENT, np.arange(HOT))
        ray.get(here.put.remote(hot, size, head))
        readers(here, peer, hot, size, 10)  # connections, registrations
        idle = readers(here, peer, hot, size, gets)
        with PoolClient(config) as client:
            before = counters(client, head)
            n = busy_bytes // size
            cold = chunk_keys(IDENT, np.arange(HOT, HOT + n))
            work = writer.put.remote(cold, size, head)  # runs while the readers read
            busy = readers(here, peer, hot, size, gets)
            put_s = ray.get(work).wall_s
            after = counters(client, head)
        row: dict[str, Any] = {
            "size_mib": size // MiB,
            "gets": gets,
            "busy_mib": busy_bytes // MiB,
            "cpus": os.cpu_count(),
        }
        for who in idle:
            (i50, i99), (b50, b99) = p50_p99(idle[who]), p50_p99(busy[who])
            row[who] = {
                "idle_p50_ms": i50,
                "idle_p99_ms": i99,
                "busy_p50_ms": b50,
                "busy_p99_ms": b99,
                "ratio": b99 / i99,
            }
        row["node_did"] = {k: after[k] - before[k] for k in after} | {"writer_s": put_s}
        return row
    finally:
        close_clients([here, peer, writer])


def run(args: argparse.Namespace) -> dict[str, Any]:
    nvme_dir = tempfile.mkdtemp(prefix="kvpool-bench-busy-")
    key_id, secret = SeaweedServer.generate_credentials()
    try:
        with (
            EmbeddedEtcd() as etcd, LocalRayCluster(nodes=2) as cluster,
            SeaweedServer(access_key_id=key_id, secret_access_key=secret) as s3,
        ):  # fmt: skip
            s3.create_bucket("kvpool-busy")
            remote = RemoteConfig(
                bucket="kvpool-busy", endpoint_url=s3.endpoint_url, access_key_id=key_id, secret_access_key=secret,
                flush_after_s=0.5,
            )  # fmt: skip
            config = PoolConfig(
                metadata=MetadataConfig(endpoints=(etcd.endpoint,), cluster="busy"), dram_bytes=DRAM_MIB * MiB,
                nvme_bytes=NVME_MIB * MiB, nvme_dir=nvme_dir, watermarks=Watermarks(high=0.8, low=0.6),
                remote=remote, namespace=f"busy-{uuid.uuid4().hex[:6]}",
            )  # fmt: skip
            head, second = cluster.node_ids()
            start_pool(config)
            try:
                return measure(config, head, second, args.size_mib * MiB, args.gets, args.busy_mib * MiB)
            finally:
                stop_pool(config)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)


def render(row: dict[str, Any], console: Console) -> None:
    table = Table(title=f"{row['size_mib']} MiB gets, one key a call: idle node vs node demoting and flushing "
                        f"({row['busy_mib']} MiB put meanwhile; {row['cpus']} CPUs)")  # fmt: skip
    for col in ("reader", "idle p50 ms", "idle p99 ms", "busy p50 ms", "busy p99 ms", "busy/idle p99 (goal <= 2)"):
        table.add_column(col, justify="right")
    for who in ("same node", "from a peer"):
        r = row[who]
        table.add_row(
            who, *(f"{r[k]:.2f}" for k in ("idle_p50_ms", "idle_p99_ms", "busy_p50_ms", "busy_p99_ms", "ratio"))
        )
    console.print(table)
    did = row["node_did"]
    console.print(
        f"meanwhile the node demoted {did['migrations']} chunks to NVMe, flushed {did['flushed']} "
        f"({did['flushed_bytes'] / MiB:.0f} MiB) to S3, dropped {did['drops']}; the writer took {did['writer_s']:.1f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=4, help="chunk size, MiB (default 4)")
    ap.add_argument("--gets", type=int, default=200, help="gets per reader and phase (default 200)")
    ap.add_argument("--busy-mib", type=int, default=1024, help="bytes the writer puts while busy, MiB (default 1024)")
    ap.add_argument("--json", default="bench/results/busy.json", help="where to write the figures")
    args = ap.parse_args()
    console = Console(width=max(Console().width, 120))
    row = run(args)
    render(row, console)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(row, indent=2))
    console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
