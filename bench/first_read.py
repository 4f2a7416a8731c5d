"""A fresh client's first read from another node, with and without connecting to the pool's nodes first.

The first P/D request of an engine was the slowest by far (issue #30): its pool client met every peer for the first
time in that request — the node actor's first call (Ray connects on first use), the transport agent and its staging
buffer, the peer's descriptor, and the transport's own wire-up on the first transfer.  ``PoolClient.connect_peers``
does all of it when an engine starts.  Here, on a 2-node local cluster (embedded etcd, ``LocalRayCluster`` on
127.0.0.2-3, a pool node on each): chunks are put on the first node, then per repeat a fresh client in an actor on the
second node reads them in batches of ``--batch`` chunks — cold (its first read pays for the connections) and warm
(``connect_peers`` first, timed on its own).  Beside them: the same client's later reads (``get_batch``: new buffers
each time), its reads into memory registered with the transport once (``get_into_batch``, as an engine reads into
its KV cache: the P/D steady state), and the floor, the batch's bytes at this machine's memcpy speed.

    python bench/first_read.py [--repeat 3] [--batch 30] [--chunk-kib 192] [--json bench/results/first_read.json]
"""

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from rich.console import Console
from rich.table import Table

from kvpool.bench.limits import memcpy_gbps
from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.servers.etcd import EmbeddedEtcd
from kvpool.servers.ray_cluster import LocalRayCluster

console = Console(width=140)


class Reader:
    """A fresh pool client on its node: times ``connect_peers`` (when ``warm``) and each batch's ``get_batch``."""

    def run(self, config: PoolConfig, batches: list[list[bytes]], warm: bool) -> dict[str, Any]:
        from kvpool.pool.client import PoolClient

        with PoolClient(config) as client:
            out: dict[str, Any] = {}
            if warm:
                started = time.perf_counter()
                out["peers"] = client.connect_peers()
                out["connect_s"] = time.perf_counter() - started
            gets = []
            for keys in batches:
                started = time.perf_counter()
                client.get_batch(keys)
                gets.append(time.perf_counter() - started)
            out["first_s"], out["later_s"] = gets[0], statistics.median(gets[1:])
            # then as an engine reads: into its KV memory, registered with the transport once, again and again
            size = len(client.get(batches[0][0]))
            kv = np.empty(len(batches[0]) * size, dtype=np.uint8)
            client.register_buffer(kv)
            steady = []
            for _ in range(STEADY_ROUNDS):
                for keys in batches:
                    started = time.perf_counter()
                    client.get_into_batch(keys, [kv[i * size : (i + 1) * size] for i in range(len(keys))])
                    steady.append(time.perf_counter() - started)
            out["steady_s"] = statistics.median(steady)
            return out


READER: Any = ray.remote(num_cpus=0)(Reader)
STEADY_ROUNDS = 5  #: passes over the batches into registered memory, after the timed first and later reads


def measure(args: argparse.Namespace) -> dict[str, Any]:
    size = args.chunk_kib * 1024
    with EmbeddedEtcd() as etcd, LocalRayCluster(nodes=2):
        metadata = MetadataConfig(endpoints=(etcd.endpoint,), cluster=f"fr-{uuid.uuid4().hex[:8]}")
        pool = PoolConfig(metadata=metadata, dram_bytes=512 * MiB, nvme_bytes=64 * MiB, namespace="first-read")
        start_pool(pool)
        try:
            from kvpool.pool.client import PoolClient

            here = ray.get_runtime_context().get_node_id()
            (other,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
            identity = CacheIdentity(model="bench", kv_dtype="uint8", layout="bytes", chunk_size=4)
            n = args.batch * 4
            rows: list[dict[str, Any]] = []
            for r in range(args.repeat):
                keys = chunk_keys(identity, range(r * 1_000_000, r * 1_000_000 + 4 * 2 * n))[: 2 * n]
                with PoolClient(pool) as writer:
                    writer.put_batch([(k, np.random.bytes(size)) for k in keys], nodes=[here])
                for warm, part in ((False, keys[:n]), (True, keys[n:])):
                    batches = [part[i : i + args.batch] for i in range(0, n, args.batch)]
                    where = NodeAffinitySchedulingStrategy(other, soft=False)
                    reader = READER.options(scheduling_strategy=where).remote()
                    rows.append({"repeat": r, "warm": warm, **ray.get(reader.run.remote(pool, batches, warm))})
                    ray.kill(reader)
        finally:
            stop_pool(pool)
    floor = args.batch * size / (memcpy_gbps(max(64 * MiB, args.batch * size)) * 1e9)
    return {"settings": vars(args), "rows": rows, "memcpy_floor_s": floor}


def show(results: dict[str, Any]) -> None:
    args = results["settings"]
    mib = args["batch"] * args["chunk_kib"] / 1024
    table = Table(title=f"first read of a fresh client from another node: {args['batch']} chunks, {mib:.1f} MiB")
    cols = ("connect_peers ms", "first read ms", "later reads ms (median)", "into registered memory ms (median)")
    for col in ("client", *cols, "memcpy floor ms"):
        table.add_column(col, justify="left" if col == "client" else "right")
    for warm in (False, True):
        rows = [r for r in results["rows"] if r["warm"] is warm]

        def span(name: str, rows: list[dict[str, Any]] = rows) -> str:
            values = sorted(r[name] * 1e3 for r in rows)
            return f"{values[0]:.0f}-{values[-1]:.0f}" if len(values) > 1 else f"{values[0]:.0f}"

        table.add_row(
            "connect_peers first" if warm else "cold",
            span("connect_s") if warm else "-",
            span("first_s"),
            span("later_s"),
            span("steady_s"),
            f"{results['memcpy_floor_s'] * 1e3:.1f}",
        )
    console.print(table)
    console.print(f"ranges over {args['repeat']} repeats (a fresh client each); the machine's load moves every figure")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="fresh clients per case")
    ap.add_argument("--batch", type=int, default=30, help="chunks per read (a prompt's chunks of one step)")
    ap.add_argument("--chunk-kib", type=int, default=192, help="KiB per chunk (SmolLM2: 256 tokens of one layer)")
    ap.add_argument("--json", default="bench/results/first_read.json", help="where to write the figures")
    args = ap.parse_args()
    results = measure(args)
    show(results)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
