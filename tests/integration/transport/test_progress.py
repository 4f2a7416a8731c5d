"""A serving NixlTransport's progress thread sleeps on UCX's event fd while nothing arrives.  NIXL's Python wrapper
would make it spin (a whole core per pool node); kvpool hands it a timeout (transport/nixl.py's ``_agent``).  A newer
NIXL that made the override miss would show here, not as a machine that is slower everywhere."""

import os
import time

import numpy as np

from kvpool.transport.nixl import NixlTransport

IDLE_S = 2.0


def _cpu_s(tasks: set[str]) -> float:
    """CPU seconds used so far by the threads ``tasks`` of this process (those that still exist)."""
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def test_an_idle_target_sleeps_instead_of_spinning() -> None:
    before = set(os.listdir("/proc/self/task"))
    target = NixlTransport(serve=True)
    try:
        buffer = np.zeros(1 << 20, dtype=np.uint8)
        target.register("dram0", buffer.ctypes.data, buffer.nbytes)
        threads = set(os.listdir("/proc/self/task")) - before  # NIXL's and UCX's, made for this agent
        assert threads, "a serving agent runs a progress thread"
        start = _cpu_s(threads)
        time.sleep(IDLE_S)
        used = _cpu_s(threads) - start
    finally:
        target.close()
    # spinning, the thread takes whatever a core gives it: on a busy 2-core machine still well over a quarter of the
    # time; sleeping, a few milliseconds
    assert used < IDLE_S / 4, f"an idle target's threads used {used:.2f} CPU-s in {IDLE_S} s: its progress spins"
