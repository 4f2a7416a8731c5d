"""What a batch costs in calls: the latency of puts and gets of small chunks, where the calls dominate, beside
the calls themselves (a bare round trip to the node actor, one etcd transaction) measured in the same run.

A put of a batch is one ``complete_store`` call (which publishes the placements in one etcd transaction) plus the wait
for the writer's own watch cache to show them; a same-node get of chunks in DRAM is no call at all (checksummed
copies out of the mapped segment, the node told of the hits without waiting).  So a put's floor is about one round
trip plus one transaction plus a watch event, and a get's is the copy.

Starts its own pool (embedded etcd, a one-node local Ray cluster).

    python bench/calls.py [--chunks 8] [--size-kib 64] [--repeat 300] [--json bench/results/calls.json]
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.pool.client import PoolClient
from kvpool.stack import StackConfig, running_pool


def percentiles(fn: Callable[[int], object], repeat: int) -> dict[str, float]:
    """p50 and p99 in ms of ``fn(i)`` over ``repeat`` calls, after a tenth as many unmeasured."""
    warm = max(1, repeat // 10)
    for i in range(warm):
        fn(i)
    times = []
    for i in range(warm, warm + repeat):
        t = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t) * 1e3)
    q = statistics.quantiles(times, n=100)
    return {"p50_ms": statistics.median(times), "p99_ms": q[98]}


def measure(client: PoolClient, chunks: int, size: int, repeat: int) -> dict[str, dict[str, float]]:
    ident = CacheIdentity(model="bench-calls", kv_dtype="u8", layout="bytes", chunk_size=1)
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    keys = chunk_keys(ident, range(chunks * (repeat + repeat // 10 + 1)))
    batches = [keys[i : i + chunks] for i in range(0, len(keys), chunks)]
    bufs = [np.empty(size, dtype=np.uint8) for _ in range(chunks)]
    node = client.nodes[client.node_id]  # the pool node on this Ray node
    out = {
        "put": percentiles(lambda i: client.put_batch([(k, data) for k in batches[i]]), repeat),
        "get (same node, DRAM)": percentiles(lambda i: client.get_into_batch(batches[i], bufs), repeat),
        "actor round trip": percentiles(lambda i: node.info(), repeat),
        "etcd transaction": percentiles(lambda i: client.etcd.put(b"/kvpool-bench-calls/x", b"%d" % i), repeat),
    }
    client.remove_batch(keys)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=8, help="chunks per batch (default 8)")
    ap.add_argument("--size-kib", type=int, default=64, help="bytes per chunk, KiB (default 64)")
    ap.add_argument("--repeat", type=int, default=300, help="timed batches per row (default 300)")
    ap.add_argument("--json", default="bench/results/calls.json", help="where to write the figures")
    args = ap.parse_args()
    console = Console()
    with (
        console.status("starting etcd, Ray and a pool node"),
        running_pool(StackConfig(nodes=1)) as pool,
        PoolClient(pool) as client,
    ):
        rows = measure(client, args.chunks, args.size_kib << 10, args.repeat)
    table = Table(
        title=f"kvpool: a batch of {args.chunks} x {args.size_kib} KiB, latency in ms ({args.repeat} batches)"
    )
    for col in ("operation", "p50", "p99"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for name, r in rows.items():
        table.add_row(name, f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}")
    console.print(table)
    console.print("a put's floor: about one actor round trip + one etcd transaction + its watch event")
    result: dict[str, Any] = {"chunks": args.chunks, "size_kib": args.size_kib, "repeat": args.repeat, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
