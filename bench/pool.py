"""Pool throughput: put/get GB/s for 1, 4, 16 and 64 MiB values, same node and cross node.

Starts its own pool (embedded etcd, a local 2-node Ray cluster on loopback, one PoolNode per node) and
prints each figure beside the limits of this machine measured in the same run: single-thread memcpy
and raw O_DIRECT disk I/O.  Cross-node data moves by one-sided NIXL/UCX READ/WRITE.

    python bench/pool.py [--sizes 1,4,16,64] [--mib-per-size 256] [--json bench/results/pool.json]
"""

import argparse
import json
import os
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

from kvpool.bench.limits import disk_gbps, gbps, median_seconds, memcpy_gbps
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.keys import CacheIdentity, chunk_keys
from kvpool.pool.node import start_pool, stop_pool
from kvpool.servers.etcd import EmbeddedEtcd
from kvpool.servers.ray_cluster import LocalRayCluster

IDENT = CacheIdentity(model="bench", kv_dtype="uint8", layout="bytes", chunk_size=1)


def get_all(client: PoolClient, keys: list[bytes], bufs: list[np.ndarray]) -> float:
    """Read every key, in batches of ``len(bufs)`` into the same buffers; returns the seconds taken."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), len(bufs)):
        batch = keys[i : i + len(bufs)]
        client.get_into_batch(batch, bufs[: len(batch)])
    return time.perf_counter() - t0


def remote_get(remote: Any, keys: list[bytes], size: int) -> float:
    """One timed pass of reads on the second node (seconds, measured there)."""
    return float(ray.get(remote.get.remote(keys, size)))


@ray.remote(num_cpus=0)
class RemoteSide:
    """A client on the second node: puts there (so a get from the head crosses nodes), reads from there."""

    def __init__(self, config: PoolConfig) -> None:
        self.client = PoolClient(config)

    def put(self, keys: list[bytes], size: int, nodes: list[str]) -> float:
        data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        t0 = time.perf_counter()
        self.client.put_batch([(k, data) for k in keys], nodes=nodes)
        return time.perf_counter() - t0

    def get(self, keys: list[bytes], size: int) -> float:
        bufs = [np.empty(size, dtype=np.uint8) for _ in range(min(len(keys), 8))]
        for b in bufs:  # registered once, as a serving engine registers its KV buffers
            self.client.register_buffer(b)
        try:
            return get_all(self.client, keys, bufs)
        finally:
            for b in bufs:
                self.client.unregister_buffer(b)

    def remove(self, keys: list[bytes]) -> None:
        for k in keys:
            self.client.remove(k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16,64", help="value sizes in MiB (default 1,4,16,64)")
    ap.add_argument("--mib-per-size", type=int, default=256, help="bytes moved per measurement, MiB (default 256)")
    ap.add_argument("--json", default="bench/results/pool.json", help="where to write the figures")
    args = ap.parse_args()
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    total = args.mib_per_size * MiB
    console = Console()
    rows: list[dict[str, Any]] = []

    with EmbeddedEtcd() as etcd, LocalRayCluster(nodes=2) as cluster:
        head, second = cluster.node_ids()
        nvme_dir = tempfile.mkdtemp(prefix="kvpool-bench-nvme-")
        config = PoolConfig(
            metadata=MetadataConfig(endpoints=(etcd.endpoint,), cluster="bench"),
            dram_bytes=total + 256 * MiB, nvme_bytes=-1, namespace=f"bench-{uuid.uuid4().hex[:6]}",
        )  # fmt: skip
        start_pool(config)
        remote = RemoteSide.options(  # type: ignore[attr-defined]
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(second, soft=False)
        ).remote(config)
        try:
            with PoolClient(config) as client:
                for size in sizes:
                    n = max(1, total // size)
                    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
                    row: dict[str, Any] = {"size_mib": size // MiB, "values": n}
                    keys = chunk_keys(IDENT, np.arange(n) + size)  # distinct keys per size

                    t0 = time.perf_counter()
                    client.put_batch([(k, data) for k in keys])
                    row["put_same"] = gbps(n * size, time.perf_counter() - t0)
                    bufs = [np.empty(size, dtype=np.uint8) for _ in range(min(n, 8))]

                    row["get_same"] = gbps(n * size, median_seconds(partial(get_all, client, keys, bufs), 3))
                    for k in keys:
                        client.remove(k)

                    row["put_cross"] = gbps(n * size, ray.get(remote.put.remote(keys, size, [head])))
                    row["get_cross"] = gbps(n * size, median_seconds(partial(remote_get, remote, keys, size), 3))
                    ray.get(remote.remove.remote(keys))
                    row["memcpy"] = memcpy_gbps(size)
                    row["disk_write"], row["disk_read"] = disk_gbps(nvme_dir, max(size, 64 * MiB))
                    rows.append(row)
                    console.print(f"{size // MiB} MiB done")
        finally:
            stop_pool(config)
            os.rmdir(nvme_dir)

    table = Table(title=f"kvpool pool throughput, GB/s ({args.mib_per_size} MiB moved per cell; cross node = NIXL/UCX)")
    for col in ("value", "put same node", "get same node", "put cross node", "get cross node",
                "memcpy (1 thread)", "raw disk O_DIRECT w / r"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['size_mib']} MiB", f"{r['put_same']:.2f}", f"{r['get_same']:.2f}", f"{r['put_cross']:.2f}",
            f"{r['get_cross']:.2f}", f"{r['memcpy']:.2f}", f"{r['disk_write']:.2f} / {r['disk_read']:.2f}",
        )  # fmt: skip
    console.print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
