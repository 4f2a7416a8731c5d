"""This machine's own limits, measured in the same run as a benchmark: memcpy, loopback TCP, O_DIRECT disk."""

import mmap
import os
import socket
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvpool.pool.config import MiB


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def median_seconds(fn: Callable[[], float], repeat: int) -> float:
    """Median of ``repeat`` runs of ``fn``, which returns its own elapsed seconds."""
    return statistics.median(fn() for _ in range(repeat))


def memcpy_gbps(size: int = 64 * MiB, repeat: int = 5) -> float:
    """Single-thread copy of ``size`` bytes between two warm buffers."""
    src, dst = np.ones(size, dtype=np.uint8), np.empty(size, dtype=np.uint8)

    def once() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    return gbps(size, median_seconds(once, repeat))


def socket_gbps(total: int = 256 * MiB, block: int = 4 * MiB, host: str = "127.0.0.1") -> float:
    """One TCP stream over loopback, ``total`` bytes in ``block``-sized sends, received into one buffer."""
    with socket.create_server((host, 0)) as server:
        port = server.getsockname()[1]
        payload = memoryview(bytearray(os.urandom(block)))

        def send() -> None:
            with socket.create_connection((host, port)) as s:
                for _ in range(total // block):
                    s.sendall(payload)

        sender = threading.Thread(target=send, daemon=True)
        t0 = time.perf_counter()
        sender.start()
        conn, _ = server.accept()
        with conn:
            buf, got = memoryview(bytearray(block)), 0
            while got < total // block * block:
                n = conn.recv_into(buf)
                if not n:
                    break
                got += n
        elapsed = time.perf_counter() - t0
        sender.join()
    return gbps(got, elapsed)


def disk_gbps(directory: str, size: int = 128 * MiB) -> tuple[float, float]:
    """O_DIRECT write (then fsync) and read of ``size`` bytes in 16 MiB blocks; GB/s each."""
    block = min(size, 16 * MiB)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(block))
    path = os.path.join(directory, f"kvpool-bench-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, size, block):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, size, block):
            os.preadv(fd, [buf], off)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()
    return gbps(size, write_s), gbps(size, read_s)


@dataclass
class Limits:
    memcpy: float
    socket: float
    disk_write: float
    disk_read: float


def measure_limits(disk_dir: str | None = None) -> Limits:
    directory = disk_dir or tempfile.gettempdir()
    w, r = disk_gbps(directory)
    return Limits(memcpy_gbps(), socket_gbps(), w, r)
