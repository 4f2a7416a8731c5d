"""Warm restart: how long a node takes to take back the NVMe chunks its last run left, beside the disk's own read rate.

No Ray, no etcd: the same steps a ``PoolNode`` runs at start (``kvpool.pool.node.journal``), on a real segment file.  A
store fills ``--nvme-mib`` of NVMe with chunks of ``--chunk-kib`` (put in DRAM, moved down, every change told to the
journal as the node's publisher tells it); the node "dies" (files closed); a new one opens the segment, replays the
journal, reads and checks every chunk (``IO_THREADS`` reads at once, as the node does) and adopts them.  Printed beside
it: O_DIRECT read of the same directory (the limit: a restart reads every byte once) and crc32c over memory (the
checksum's own rate).  Columns: replay = open the journal and replay it; read+verify = read every chunk and check
its checksum; adopt = book the chunks in the store and rewrite the journal; B/chunk = journal bytes per chunk.  Publishing the placements to etcd afterwards is one batched publish, measured by
``bench/metadata.py``.

    python bench/restart.py [--nvme-mib 512] [--chunk-kib 2048] [--dir DIR] [--json bench/results/restart.json]
"""

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpool.bench.limits import disk_gbps, gbps
from kvpool.core.types import Tier
from kvpool.pool.chunks import checksum
from kvpool.pool.config import MiB
from kvpool.pool.node.journal import NvmeJournal, recover, segment_name
from kvpool.pool.node.node import IO_THREADS
from kvpool.pool.node.store import ChunkStore
from kvpool.pool.segment import DramSegment

NAME = segment_name("bench", "127.0.0.1")


def fill(directory: str, nvme_bytes: int, chunk: int) -> int:
    """A node's run: chunks put and moved to NVMe until it is full; returns how many."""
    dram = DramSegment.create(4 * chunk, "/dev/shm")
    nvme, journal, _ = NvmeJournal.open(directory, NAME, nvme_bytes)
    journal.rewrite([])
    store = ChunkStore(dram, nvme)
    data = bytearray(np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    n = nvme_bytes // chunk
    try:
        for i in range(n):
            data[:8] = i.to_bytes(8, "little")  # every chunk its own bytes
            key = i.to_bytes(32, "big")
            store.put(key, memoryview(data), checksum(data))
            store.move(key, Tier.NVME)
            journal.record(store.take_changes())
    finally:
        journal.close()
        nvme.close()
        dram.close()
    return n


def restart(directory: str, nvme_bytes: int) -> dict[str, float]:
    """The next node's start on the same files: open + replay, read + verify, adopt; seconds of each."""
    dram = DramSegment.create(MiB, "/dev/shm")
    t0 = time.perf_counter()
    nvme, journal, named = NvmeJournal.open(directory, NAME, nvme_bytes)
    t1 = time.perf_counter()
    with ThreadPoolExecutor(IO_THREADS) as io:
        recovery = recover(nvme, named, io)
    t2 = time.perf_counter()
    store = ChunkStore(dram, nvme)
    store.adopt(recovery.adopted, recovery.dropped)
    journal.rewrite(recovery.adopted)
    t3 = time.perf_counter()
    journal_bytes = os.path.getsize(journal.path)
    journal.close()
    nvme.close()
    dram.close()
    return {
        "chunks": len(recovery.adopted),
        "dropped": len(recovery.dropped),
        "bytes": recovery.bytes_read,
        "replay_s": t1 - t0,
        "verify_s": t2 - t1,
        "adopt_s": t3 - t2,
        "total_s": t3 - t0,
        "journal_bytes_per_chunk": journal_bytes / max(len(recovery.adopted), 1),
    }


def crc_gbps(size: int) -> float:
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    checksum(data)
    return gbps(size, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme-mib", type=int, default=512, help="NVMe segment to fill and take back")
    ap.add_argument("--chunk-kib", type=int, default=2048, help="bytes per chunk")
    ap.add_argument("--dir", default="", help="where the segment lives (default: a temp dir)")
    ap.add_argument("--json", default="bench/results/restart.json", help="where to write the figures")
    args = ap.parse_args()
    console = Console()
    nvme_bytes, chunk = args.nvme_mib * MiB, args.chunk_kib * 1024
    with tempfile.TemporaryDirectory(dir=args.dir or None) as directory:
        with console.status(f"filling {args.nvme_mib} MiB of NVMe with {args.chunk_kib} KiB chunks"):
            n = fill(directory, nvme_bytes, chunk)
        with console.status("restarting on the same segment"):
            row = restart(directory, nvme_bytes)
        _, disk_read = disk_gbps(directory, min(nvme_bytes, 256 * MiB))
    row |= {
        "verify_gbps": gbps(int(row["bytes"]), row["verify_s"]),
        "disk_read_gbps": disk_read,
        "crc32c_gbps": crc_gbps(64 * MiB),
        "filled": n,
    }
    table = Table(title=f"warm restart: {n} chunks of {args.chunk_kib} KiB on {args.nvme_mib} MiB of NVMe")
    for col in (
        "taken back",
        "replay",
        "read+verify",
        "adopt",
        "total",
        "GB/s",
        "limit: disk GB/s",
        "crc GB/s",
        "B/chunk",
    ):
        table.add_column(col, justify="right")
    table.add_row(
        f"{row['chunks']}/{n}",
        f"{row['replay_s'] * 1e3:.1f} ms",
        f"{row['verify_s']:.2f} s",
        f"{row['adopt_s'] * 1e3:.1f} ms",
        f"{row['total_s']:.2f} s",
        f"{row['verify_gbps']:.2f}",
        f"{disk_read:.2f}",
        f"{row['crc32c_gbps']:.2f}",
        f"{row['journal_bytes_per_chunk']:.0f}",
    )
    console.print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(row, indent=2))
    console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
