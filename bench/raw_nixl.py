"""Raw NIXL, the transport under the pool: one-sided READ and WRITE of one value per call between two processes,
a target process of ``bench/transfer.py`` serving a ``DramSegment`` registered as ``dram0`` and this one initiating."""

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.bench.children import SCRIPT, progress, stop_process
from kvpool.bench.limits import measure, proc_cpu_s
from kvpool.pool.config import MiB

TARGET_MIN_BYTES = 160 * MiB  #: the raw NIXL target's segment (at least two of the largest values)
IDLE_S = 5.0  #: how long :func:`idle_target_percent` watches a connected target move nothing


def run_target(capacity: int) -> None:
    """``--_target``: serve a DramSegment as ``dram0``; print ``DESCRIPTOR <hex> <path>``; exit on EOF/quit."""
    from kvpool.pool.segment import DramSegment
    from kvpool.transport.nixl import NixlTransport

    seg = DramSegment.create(capacity, name=f"{uuid.uuid4().hex[:16]}-{os.getpid()}")  # the pool's reaper knows it
    transport = None
    try:
        transport = NixlTransport(serve=True)
        transport.register("dram0", seg.base_address, seg.capacity)
        print("DESCRIPTOR", transport.descriptor().hex(), seg.path, flush=True)
        for line in sys.stdin:
            if line.strip() == "quit":
                break
    finally:
        if transport is not None:
            transport.close()
        seg.close()


class Target:
    def __init__(self, capacity: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, SCRIPT, "--_target", str(capacity)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.path = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # NIXL logs to stdout too: skip to our line
            if line.startswith("DESCRIPTOR "):
                _, hexed, self.path = line.split()
                self.descriptor = bytes.fromhex(hexed)
                return
        self.stop()
        raise RuntimeError(f"the NIXL target exited ({self.proc.returncode}) without a descriptor")

    def stop(self) -> None:
        stop_process(self.proc, quit_stdin=True)
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # left behind only if the target was killed


def nixl_rows(sizes: list[int], total: int) -> list[dict[str, Any]]:
    from kvpool.transport.base import Op
    from kvpool.transport.nixl import NixlTransport

    capacity = max(TARGET_MIN_BYTES, 2 * max(sizes))
    rows: list[dict[str, Any]] = []
    target = Target(capacity)
    transport = None
    try:
        transport = NixlTransport()
        buf = np.ones(max(sizes), dtype=np.uint8)  # pages faulted in now, not in the first transfer
        transport.register("local", buf.ctypes.data, buf.nbytes)
        peer = transport.connect(target.descriptor)
        for size in sizes:
            n = max(1, total // size)
            slots = capacity // size
            for op in ("READ", "WRITE"):
                move = transport.read if op == "READ" else transport.write

                def one_pass(
                    move: Callable[..., None] = move, size: int = size, n: int = n, slots: int = slots
                ) -> None:
                    for i in range(n):
                        move(peer, [Op("dram0", (i % slots) * size, buf.ctypes.data, size)], timeout_s=60)

                row = measure(one_pass, n * size, n, target_pid=target.proc.pid)
                rows.append({"size_mib": size // MiB, "op": op, **row})
            progress(f"NIXL {size // MiB} MiB done")
    finally:
        if transport is not None:
            transport.close()
        target.stop()
    return rows


def idle_target_percent(capacity: int = TARGET_MIN_BYTES) -> float:
    """Percent of a core a serving target uses while connected and moving nothing, over ``IDLE_S`` (what a pool node
    costs between transfers: its UCX progress thread)."""
    from kvpool.transport.nixl import NixlTransport

    target = Target(capacity)
    transport = NixlTransport()
    try:
        transport.connect(target.descriptor)
        time.sleep(1.0)  # past the connection's wire-up
        before = proc_cpu_s(target.proc.pid)
        time.sleep(IDLE_S)
        return 100 * (proc_cpu_s(target.proc.pid) - before) / IDLE_S
    finally:
        transport.close()
        target.stop()
