"""Reads while the node works: the latency of a 4 MiB get from a node that is demoting to NVMe and flushing to S3,
beside the same gets from the same node idle.

Starts its own pool (embedded etcd, a local 2-node Ray cluster, SeaweedFS on loopback as the remote tier) with a small
DRAM segment and ``flush_after_s`` short, so that a stream of puts into the head node keeps it demoting LRU chunks
to NVMe and uploading idle NVMe chunks to S3.  A hot set of chunks stays in the head node's DRAM; it is read one key
per call by a client on the head node (same node: out of the mapped segment) and by one on the other node (a peer:
a pin call on the busy node, a NIXL READ, a release), one reader after the other, first with nothing else going on,
then while a writer on the head node keeps putting new chunks; each reader reads for ``--seconds`` a phase.  The table gives p50 and p99 of each, the ratio
of busy to idle p99 (the goal: at most 2) and what the node did meanwhile (chunks demoted, flushed, dropped).

The machine's cores are shared by the writer, the node's I/O threads, SeaweedFS and the readers: on 2 cores part of
the busy p99 is plain CPU contention, which no design of the node removes.  So a third phase reads beside a CPU
burner (one process spinning, nothing else): what the gets lose to a busy CPU alone, to compare the busy node with.

    python bench/busy.py [--size-mib 4] [--seconds 5] [--json bench/results/busy.json]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

from kvpool.bench.node_client import close_clients, node_clients
from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig, Watermarks
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


def readers(here: Any, peer: Any, keys: list[bytes], size: int, seconds: float) -> dict[str, list[float]]:
    """Latencies of the single-key gets each reader makes in ``seconds``, one reader after the other (two readers at
    once on 2 cores measured each other: the peer's "idle" p99 was many times its p50)."""
    return {
        "same node": ray.get(here.latencies.remote(keys, size, seconds)),
        "from a peer": ray.get(peer.latencies.remote(keys, size, seconds)),
    }


def measure(config: PoolConfig, head: str, second: str, size: int, seconds: float) -> dict[str, Any]:
    here, peer, writer = node_clients(config, [head, second, head])
    try:
        hot = chunk_keys(IDENT, np.arange(HOT))
        ray.get(here.put.remote(hot, size, head))
        readers(here, peer, hot, size, 0.5)  # connections, registrations
        phases = {"idle": readers(here, peer, hot, size, seconds)}
        burner = subprocess.Popen(["sh", "-c", "while :; do :; done"])
        try:
            phases["cpu burner"] = readers(here, peer, hot, size, seconds)
        finally:
            burner.kill()
            burner.wait()
        with PoolClient(config) as client:
            before = counters(client, head)
            work = writer.put_for.remote(uuid.uuid4().hex, size, head, 2 * seconds)  # while both readers read
            phases["busy node"] = readers(here, peer, hot, size, seconds)
            put = ray.get(work)
            after = counters(client, head)
        row: dict[str, Any] = {"size_mib": size // MiB, "seconds": seconds, "cpus": os.cpu_count()}
        for who in ("same node", "from a peer"):
            cells: dict[str, Any] = {
                p: dict(zip(("p50_ms", "p99_ms"), p50_p99(got[who]), strict=True)) for p, got in phases.items()
            }
            cells["ratio"] = cells["busy node"]["p99_ms"] / cells["idle"]["p99_ms"]
            cells["gets"] = {p: len(got[who]) for p, got in phases.items()}
            row[who] = cells
        row["node_did"] = {k: after[k] - before[k] for k in after} | {"put_mib": put * size // MiB}
        return row
    finally:
        close_clients([here, peer, writer])


def run(args: argparse.Namespace) -> dict[str, Any]:
    nvme_dir = tempfile.mkdtemp(prefix="kvpool-bench-busy-")
    key_id, secret = SeaweedServer.generate_credentials()
    try:
        with (
            EmbeddedEtcd() as etcd,
            LocalRayCluster(nodes=2) as cluster,
            SeaweedServer(access_key_id=key_id, secret_access_key=secret) as s3,
        ):
            s3.create_bucket("kvpool-busy")
            remote = RemoteConfig(
                bucket="kvpool-busy",
                endpoint_url=s3.endpoint_url,
                access_key_id=key_id,
                secret_access_key=secret,
                flush_after_s=0.5,
            )
            config = PoolConfig(
                metadata=MetadataConfig(endpoints=(etcd.endpoint,), cluster="busy"),
                dram_bytes=DRAM_MIB * MiB,
                nvme_bytes=NVME_MIB * MiB,
                nvme_dir=nvme_dir,
                watermarks=Watermarks(high=0.8, low=0.6),
                remote=remote,
                namespace=f"busy-{uuid.uuid4().hex[:6]}",
            )
            head, second = cluster.node_ids()
            start_pool(config)
            try:
                return measure(config, head, second, args.size_mib * MiB, args.seconds)
            finally:
                stop_pool(config)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)


def render(row: dict[str, Any], console: Console) -> None:
    title = (
        f"{row['size_mib']} MiB gets, one key a call, {row['seconds']:.0f} s a phase: p50 / p99 ms ({row['cpus']} CPUs)"
    )
    table = Table(title=title)
    phases = ("idle", "cpu burner", "busy node")
    for col in ("reader", *phases, "busy/idle p99 (goal <= 2)", "gets"):
        table.add_column(col, justify="right")
    for who in ("same node", "from a peer"):
        r = row[who]
        cells = [f"{r[p]['p50_ms']:.2f} / {r[p]['p99_ms']:.2f}" for p in phases]
        table.add_row(who, *cells, f"{r['ratio']:.2f}", " / ".join(str(r["gets"][p]) for p in phases))
    console.print(table)
    did = row["node_did"]
    console.print(
        f"busy node: a writer there put {did['put_mib']} MiB; the node demoted {did['migrations']} chunks to NVMe, "
        f"flushed {did['flushed']} ({did['flushed_bytes'] / MiB:.0f} MiB) to S3 and dropped {did['drops']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=4, help="chunk size, MiB (default 4)")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each phase, seconds (default 5)")
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
