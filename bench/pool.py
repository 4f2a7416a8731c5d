"""Pool throughput: put/get GB/s for 1, 4, 16 and 64 MiB values, same node and cross node.

Starts its own pool (embedded etcd, a local 2-node Ray cluster on loopback, one PoolNode per node) and
prints each figure beside the limits of this machine measured in the same run: single-thread memcpy
and raw O_DIRECT disk I/O.  Cross-node data moves by one-sided NIXL/UCX READ/WRITE.  The NVMe rows read chunks
moved to the NVMe tier before each pass (the node reads them, promoting them to DRAM, several at once).

    python bench/pool.py [--sizes 1,4,16,64] [--mib-per-size 256] [--json bench/results/pool.json]
"""

import argparse
import json
import mmap
import os
import shutil
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
from kvpool.bench.node_client import close_clients, get_all, node_clients
from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.servers.etcd import EmbeddedEtcd
from kvpool.servers.ray_cluster import LocalRayCluster

IDENT = CacheIdentity(model="bench", kv_dtype="uint8", layout="bytes", chunk_size=1)


def _get_one_by_one(client: PoolClient, keys: list[bytes], buf: np.ndarray) -> float:
    """Seconds to read every key with the single-key ``get_into``, one after the other."""
    t0 = time.perf_counter()
    for k in keys:
        client.get_into(k, buf)
    return time.perf_counter() - t0


def _get_from_nvme(client: PoolClient, keys: list[bytes], bufs: list[np.ndarray], raw: list[float]) -> float:
    """Seconds to read ``keys`` after moving them to this node's NVMe (the move is not timed): each hit is read
    from NVMe (and promoted to DRAM, the default) by the node, then copied here.  Just before, the same byte
    ranges of the segment file are read with O_DIRECT in one thread (no pool): their seconds go to ``raw``."""
    client.move(keys, Tier.NVME)
    client.cache.sync()
    ranges = [(p.offset, p.stored) for k in keys for p in client.cache.replicas(k) if p.tier is Tier.NVME]
    assert client.info is not None
    raw.append(_read_ranges(client.info.nvme_path, ranges))
    return get_all(client, keys, bufs)


def _read_ranges(path: str, ranges: list[tuple[int, int]]) -> float:
    """Seconds to read ``ranges`` of ``path`` with O_DIRECT into one page-aligned buffer, one after the other."""
    buf = mmap.mmap(-1, max(n for _, n in ranges))
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        t0 = time.perf_counter()
        for offset, n in ranges:
            with memoryview(buf) as view:
                os.preadv(fd, [view[:n]], offset)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()


def _replicated_put(
    client: PoolClient, keys: list[bytes], data: np.ndarray, peer: str, put_local_s: float
) -> dict[str, float]:
    """GB/s (of one copy) of a put to the other node alone, and of a replicas=2 put (this node and the other);
    beside them what the two copies written one after the other would take (this node's put + the peer's)."""
    nbytes = len(keys) * data.nbytes
    t0 = time.perf_counter()
    client.put_batch([(k, data) for k in keys], nodes=[peer])
    put_peer_s = time.perf_counter() - t0
    client.remove_batch(keys)
    t0 = time.perf_counter()
    client.put_batch([(k, data) for k in keys], replicas=2)
    both_s = time.perf_counter() - t0
    client.remove_batch(keys)
    return {
        "put_peer": gbps(nbytes, put_peer_s),
        "put_2": gbps(nbytes, both_s),
        "put_2_sequential": gbps(nbytes, put_local_s + put_peer_s),
    }


def measure(
    client: PoolClient, remote: Any, head: str, second: str, size: int, total: int, nvme_dir: str
) -> dict[str, Any]:
    """One row: put and get of ``total`` bytes in ``size``-byte values on the head node (this process), then
    from the second node (``remote``) to and from the head; beside them, memcpy and raw disk."""
    n = max(1, total // size)
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    row: dict[str, Any] = {"size_mib": size // MiB, "values": n}
    keys = chunk_keys(IDENT, np.arange(n) + size)  # distinct keys per size

    t0 = time.perf_counter()
    client.put_batch([(k, data) for k in keys])
    put_local_s = time.perf_counter() - t0
    row["put_same"] = gbps(n * size, put_local_s)
    bufs = [np.empty(size, dtype=np.uint8) for _ in range(min(n, 8))]
    row["get_same"] = gbps(n * size, median_seconds(partial(get_all, client, keys, bufs), 3))
    row["get_one"] = gbps(n * size, median_seconds(partial(_get_one_by_one, client, keys, bufs[0]), 3))
    raw: list[float] = []
    row["get_nvme"] = gbps(n * size, median_seconds(partial(_get_from_nvme, client, keys, bufs, raw), 3))
    row["nvme_raw"] = gbps(n * size, sorted(raw)[len(raw) // 2])
    row["get_nvme_peer"] = gbps(n * size, ray.get(remote.get.remote(keys, size, tier=Tier.NVME.value, repeat=3)))
    client.remove_batch(keys)
    row.update(_replicated_put(client, keys, data, second, put_local_s))

    put = ray.get(remote.put.remote(keys, size, head, batch=len(keys)))
    row["put_cross"] = gbps(n * size, put.wall_s)
    row["get_cross"] = gbps(n * size, ray.get(remote.get.remote(keys, size, repeat=3)))
    ray.get(remote.remove.remote(keys))
    row["memcpy"] = memcpy_gbps(size)
    row["disk_write"], row["disk_read"] = disk_gbps(nvme_dir, max(size, 64 * MiB))
    return row


def measure_all(sizes: list[int], total: int, console: Console) -> list[dict[str, Any]]:
    """Start the pool (embedded etcd, a local 2-node Ray cluster) and :func:`measure` each size."""
    rows = []
    with EmbeddedEtcd() as etcd, LocalRayCluster(nodes=2) as cluster:
        head, second = cluster.node_ids()
        nvme_dir = tempfile.mkdtemp(prefix="kvpool-bench-nvme-")
        config = PoolConfig(
            metadata=MetadataConfig(endpoints=(etcd.endpoint,), cluster="bench"),
            dram_bytes=total + 256 * MiB,
            nvme_bytes=total + 64 * MiB,
            nvme_dir=nvme_dir,
            namespace=f"bench-{uuid.uuid4().hex[:6]}",
        )
        start_pool(config)
        remote: list[Any] = []
        try:
            # a client on the second node: puts there (so a get from the head crosses nodes), reads from there
            remote = node_clients(config, [second])
            with PoolClient(config) as client:
                warm = chunk_keys(IDENT, [0])  # connect to the peer once, before anything is timed
                client.put_batch([(warm[0], b"w" * 4096)], nodes=[second])
                client.remove_batch(warm)
                for size in sizes:
                    rows.append(measure(client, remote[0], head, second, size, total, nvme_dir))
                    console.print(f"{size // MiB} MiB done")
        finally:
            close_clients(remote)
            stop_pool(config)
            shutil.rmtree(nvme_dir, ignore_errors=True)
    return rows


def render(rows: list[dict[str, Any]], mib_per_size: int, console: Console) -> None:
    table = Table(title=f"kvpool pool throughput, GB/s ({mib_per_size} MiB moved per cell; cross node = NIXL/UCX)")
    for col in (
        "value",
        "put here",
        "get here",
        "get here 1 key/call",
        "get NVMe here / from peer (O_DIRECT same bytes)",
        "put to peer",
        "get from peer",
        "put 2 replicas (in turn)",
        "memcpy",
        "disk O_DIRECT w / r",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['size_mib']} MiB",
            f"{r['put_same']:.2f}",
            f"{r['get_same']:.2f}",
            f"{r['get_one']:.2f}",
            f"{r['get_nvme']:.2f} / {r['get_nvme_peer']:.2f} ({r['nvme_raw']:.2f})",
            f"{r['put_cross']:.2f}",
            f"{r['get_cross']:.2f}",
            f"{r['put_2']:.2f} ({r['put_2_sequential']:.2f})",
            f"{r['memcpy']:.2f}",
            f"{r['disk_write']:.2f} / {r['disk_read']:.2f}",
        )
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16,64", help="value sizes in MiB (default 1,4,16,64)")
    ap.add_argument("--mib-per-size", type=int, default=256, help="bytes moved per measurement, MiB (default 256)")
    ap.add_argument("--json", default="bench/results/pool.json", help="where to write the figures")
    args = ap.parse_args()
    console = Console(width=max(Console().width, 120))
    rows = measure_all([int(s) * MiB for s in args.sizes.split(",")], args.mib_per_size * MiB, console)
    render(rows, args.mib_per_size, console)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
