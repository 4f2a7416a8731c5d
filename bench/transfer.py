"""Transfer throughput: raw NIXL READ/WRITE and the pool's cross-node get/put, beside this machine's limits.

For each value size (1, 4, 16, 64 MiB) it prints one table of GB/s, with operations/s and CPU-seconds
per GB under each figure:

- the limits of this machine, measured in the same run: one-thread memcpy (``np.copyto``), a raw TCP
  loopback socket and a raw Unix-domain socket (4 MiB socket buffers, ``recv_into`` a preallocated buffer);
- raw NIXL: one-sided READ and WRITE of one value per call between two processes (``NixlTransport``; the
  target serves a ``DramSegment`` registered as ``dram0``);
- an idle NIXL target: percent of a core a connected target uses while nothing moves (its UCX progress thread:
  what a pool node costs between transfers);
- the pool: a ``PoolClient`` on the second node of a local 2-node Ray cluster puts values onto the head
  node's ``PoolNode`` (NIXL WRITE) and reads them back with ``get_into_batch`` (NIXL READ, crc checked).

The NIXL and pool rows run twice, each in a fresh process of this script (UCX reads its environment when
an agent starts): with kvpool's default ``UCX_TLS=posix,cma,tcp`` and with ``UCX_TLS=tcp``, both with
``UCX_NET_DEVICES=lo``.

Beside them, a benchmark peer: Mooncake Store over TCP, when ``mooncake`` (``mooncake-transfer-engine-non-cuda``,
not a kvpool dependency; this script installs nothing) is installed, else reported as skipped.  A
``mooncake_master`` and two store clients run as separate processes (P2P handshake, no metadata server): client A
(127.0.0.2) mounts the segment that holds the values; client B (127.0.0.3, a small segment of its own)
``batch_put_from``s them onto A's segment (``preferred_segment``, checked) and ``batch_get_into``s them back, from
and into registered buffers, 8 values per call like the pool's get.  Mooncake's transfer engine listens on all
addresses whatever it is told, so these processes run in a private network namespace (``unshare --net``) that has
only a loopback interface.

    python bench/transfer.py [--sizes 1,4,16,64] [--mib-per-size 128] [--json bench/results/transfer.json]
"""

import argparse
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpool.bench.children import SCRIPT, progress, run_child
from kvpool.bench.limits import REPEAT, cell, transfer_limits
from kvpool.bench.mooncake_peer import mooncake_figures, run_mooncake, run_mooncake_holder
from kvpool.bench.raw_nixl import IDLE_S, idle_target_percent, nixl_rows, run_target
from kvpool.pool.config import MiB

SETTINGS = {  # name -> (label, UCX environment)
    "default": ("posix,cma,tcp", {"UCX_TLS": "posix,cma,tcp", "UCX_NET_DEVICES": "lo"}),
    "tcp": ("tcp", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}),
}


# -- the pool: remote put and get between the two nodes of a local Ray cluster -----------------------------


def pool_rows(sizes: list[int], total: int) -> list[dict[str, Any]]:
    """Start a pool (embedded etcd, a local 2-node Ray cluster) and :func:`pool_cells` for each size, the client
    on the second node, the chunks on the head's ``PoolNode``."""
    import ray

    from kvpool.bench.node_client import close_clients, node_clients
    from kvpool.metadata.config import MetadataConfig
    from kvpool.pool.config import PoolConfig
    from kvpool.pool.node import start_pool, stop_pool
    from kvpool.servers.etcd import EmbeddedEtcd
    from kvpool.servers.ray_cluster import LocalRayCluster

    rows: list[dict[str, Any]] = []
    with EmbeddedEtcd() as etcd, LocalRayCluster(nodes=2) as cluster:
        head, second = cluster.node_ids()
        config = PoolConfig(
            metadata=MetadataConfig(endpoints=(etcd.endpoint,), cluster="bench-transfer"),
            dram_bytes=total + 256 * MiB,
            nvme_bytes=-1,
            namespace=f"bench-{uuid.uuid4().hex[:6]}",
        )
        remote: list[Any] = []
        try:
            start_pool(config)
            remote = node_clients(config, [second])  # puts onto the head node, reads those chunks back from there
            seen = ray.get(remote[0].ucx_tls.remote())
            if seen != os.environ["UCX_TLS"]:
                raise RuntimeError(f"the Ray workers see UCX_TLS={seen!r}, not {os.environ['UCX_TLS']!r}")
            for size in sizes:
                rows += pool_cells(remote[0], head, size, total)
                progress(f"pool {size // MiB} MiB done")
        finally:
            close_clients(remote)
            stop_pool(config)
    return rows


def pool_cells(remote: Any, head: str, size: int, total: int) -> list[dict[str, Any]]:
    """The put and get rows of one value size: ``REPEAT`` timed passes of each by the ``NodeClient`` ``remote``
    (puts all in one batch, gets 8 a call into registered buffers, as Mooncake's are)."""
    import ray

    from kvpool.core.keys import CacheIdentity, chunk_keys

    ident = CacheIdentity(model="bench-transfer", kv_dtype="uint8", layout="bytes", chunk_size=1)
    n = max(1, total // size)
    keys = chunk_keys(ident, np.arange(n) + size)  # distinct keys per size
    warm = chunk_keys(ident, np.arange(1) + 10_000 + size)
    ray.get(remote.put.remote(warm, size, head, batch=len(warm)))  # connects, registers the staging buffer
    ray.get(remote.get_once.remote(warm, size))
    ray.get(remote.remove.remote(warm))
    puts = []
    for rep in range(REPEAT):  # keys name content: a stored key is not written again
        puts.append(ray.get(remote.put.remote(keys, size, head, batch=len(keys))))
        if rep < REPEAT - 1:
            ray.get(remote.remove.remote(keys))
    gets = [ray.get(remote.get_once.remote(keys, size)) for _ in range(REPEAT)]
    ray.get(remote.remove.remote(keys))
    return [
        {"size_mib": size // MiB, "op": "put", **cell(puts, n * size, n)},
        {"size_mib": size // MiB, "op": "get", **cell(gets, n * size, n)},
    ]


def run_worker(setting: str, sizes: list[int], total: int) -> None:
    """``--_worker``: the NIXL and pool rows under the UCX environment the parent set; one RESULT line."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout in the parent: run the finally blocks
    t0 = time.perf_counter()
    result: dict[str, Any] = {"setting": setting, "ucx_tls": os.environ.get("UCX_TLS", "")}
    result["nixl"] = nixl_rows(sizes, total)
    result["idle_target_percent"] = idle_target_percent()
    result["pool"] = pool_rows(sizes, total)
    result["seconds"] = time.perf_counter() - t0
    print("RESULT", json.dumps(result), flush=True)


def spawn_worker(setting: str, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", **SETTINGS[setting][1]}
    cmd = [
        sys.executable,
        SCRIPT,
        "--_worker",
        setting,
        "--sizes",
        args.sizes,
        "--mib-per-size",
        str(args.mib_per_size),
    ]
    return run_child(cmd, env, f"UCX_TLS={SETTINGS[setting][0]}", console)


# -- the table ------------------------------------------------------------------------------------------------


def fmt(cell: dict[str, Any] | None, cpu: bool = True) -> str:
    if cell is None:
        return "—"
    text = f"{cell['gbps']:.2f}\n[dim]{cell['ops_s']:,.0f}/s"
    if cpu:
        text += f" · {cell['cpu_s_per_gb']:.2f}"
        if "target_cpu_s_per_gb" in cell:
            text += f"+{cell['target_cpu_s_per_gb']:.2f}"
    return text + "[/dim]"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16,64", help="value sizes in MiB (default 1,4,16,64)")
    ap.add_argument("--mib-per-size", type=int, default=128, help="bytes moved per measurement, MiB (default 128)")
    ap.add_argument("--json", default="bench/results/transfer.json", help="where to write the figures")
    ap.add_argument("--_worker", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    ap.add_argument("--_target", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_mooncake", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_mooncake_holder", nargs=2, metavar=("MASTER", "BYTES"), help=argparse.SUPPRESS)
    return ap.parse_args()


def render(
    floor: dict[str, list[dict[str, Any]]],
    workers: dict[str, dict[str, Any]],
    mooncake: dict[str, Any],
    sizes: list[int],
    mib_per_size: int,
) -> Table:
    """One table: a row per path (and UCX setting), a column per value size."""
    table = Table(
        title=f"kvpool transfers, GB/s ({mib_per_size} MiB moved per cell, median of {REPEAT} passes)",
        caption="under each figure: operations/s · CPU-seconds per GB (sockets: both ends, one process; NIXL: "
        "initiator + target; pool: the client only)\npool: a client on node 2 puts to / gets from the pool node "
        "on node 1 (NIXL WRITE / READ plus crc32c, Ray and etcd calls)\nMooncake Store (TCP): client B "
        "batch_put_from's onto / batch_get_into's from client A's segment, 8 values per call, registered buffers "
        "(CPU: B + A)",
    )
    table.add_column("path")
    table.add_column("UCX_TLS")
    for size in sizes:
        table.add_column(f"{size // MiB} MiB", justify="right")

    def cells(rows: list[dict[str, Any]], **match: str) -> list[str]:
        found = {r["size_mib"]: r for r in rows if all(r.get(k) == v for k, v in match.items())}
        return [fmt(found.get(size // MiB)) for size in sizes]

    table.add_row("memcpy (np.copyto, 1 thread)", "", *cells(floor["memcpy"]))
    table.add_row("TCP socket 127.0.0.1", "", *cells(floor["tcp_socket"]))
    table.add_row("Unix socket", "", *cells(floor["unix_socket"]), end_section=True)
    for part, ops, name in (
        ("nixl", ("READ", "WRITE"), "NIXL {op}, 2 processes"),
        ("pool", ("get", "put"), "pool remote {op}"),
    ):
        for op in ops:
            for setting, result in workers.items():
                table.add_row(name.format(op=op), SETTINGS[setting][0], *cells(result[part], op=op))
        table.rows[-1].end_section = True
    if mooncake.get("rows"):
        for op, call in (("get", "batch_get_into"), ("put", "batch_put_from")):
            table.add_row(f"Mooncake Store {op} ({call})", "(own TCP)", *cells(mooncake["rows"], op=op))
    return table


def main() -> None:
    args = parse_args()
    if args._target:
        run_target(args._target)
        return
    if args._mooncake_holder:
        run_mooncake_holder(args._mooncake_holder[0], int(args._mooncake_holder[1]))
        return
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    total = args.mib_per_size * MiB
    if args._worker:
        run_worker(args._worker, sizes, total)
        return
    if args._mooncake:
        run_mooncake(sizes, total)
        return

    console = Console()
    console = Console(width=max(console.width, 140))  # four size columns: 80 (a pipe's default) is too narrow
    t0 = time.perf_counter()
    floor = transfer_limits(sizes, total)
    console.print("machine limits measured")
    workers = {setting: spawn_worker(setting, args, console) for setting in SETTINGS}
    mooncake = mooncake_figures(args, console)
    console.print(render(floor, workers, mooncake, sizes, args.mib_per_size))
    for setting, result in workers.items():
        console.print(
            f"idle NIXL target (connected, moving nothing, {IDLE_S:.0f} s), UCX_TLS={SETTINGS[setting][0]}: "
            f"{result['idle_target_percent']:.2f} % of a core"
        )
    console.print(mooncake["status"], markup=False)
    elapsed = time.perf_counter() - t0
    figures = {
        "sizes_mib": [s // MiB for s in sizes],
        "mib_per_size": args.mib_per_size,
        "repeat": REPEAT,
        "limits": floor,
        "settings": {s: {"label": SETTINGS[s][0], **r} for s, r in workers.items()},
        "mooncake": mooncake,
        "seconds": elapsed,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(figures, indent=2))
    console.print(f"figures written to {args.json} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
