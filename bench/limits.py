"""This machine's own limits, measured in the same run as a benchmark: memcpy, loopback TCP, O_DIRECT disk; and
the timed passes (GB/s, operations/s, CPU-seconds per GB) ``bench/transfer.py`` measures its limits and paths with."""

import contextlib
import mmap
import os
import socket
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# -- timed passes, and the limits bench/transfer.py measures with them --------------------------------------

REPEAT = 3  #: timed passes per cell; the median is reported
SOCKET_BUFFER = 4 * MiB  #: SO_SNDBUF / SO_RCVBUF of the raw sockets (the kernel caps it at [wr]mem_max)


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(one_pass: Callable[[], None], nbytes: int, ops: int, target_pid: int | None = None) -> dict[str, float]:
    """Warm up with one pass, then ``REPEAT`` timed passes that each move ``nbytes`` in ``ops`` operations.

    GB/s and ops/s from the median pass; CPU-seconds per GB of this process (and of ``target_pid``) over
    all timed passes."""
    one_pass()
    times = []
    cpu0 = time.process_time()
    tcpu0 = proc_cpu_s(target_pid) if target_pid else 0.0
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    moved_gb = REPEAT * nbytes / 1e9
    median = statistics.median(times)
    row = {"gbps": gbps(nbytes, median), "ops_s": ops / median, "cpu_s_per_gb": cpu / moved_gb}
    if target_pid:
        row["target_cpu_s_per_gb"] = (proc_cpu_s(target_pid) - tcpu0) / moved_gb
    return row


def cell(samples: Sequence[Sequence[float]], nbytes: int, ops: int) -> dict[str, float]:
    """GB/s and ops/s of the median pass, from timed passes that each moved ``nbytes`` in ``ops`` operations:
    ``(wall seconds, CPU seconds[, the target's CPU seconds])``; CPU-seconds per GB over all passes."""
    median = statistics.median(s[0] for s in samples)
    moved_gb = len(samples) * nbytes / 1e9
    row = {"gbps": gbps(nbytes, median), "ops_s": ops / median, "cpu_s_per_gb": sum(s[1] for s in samples) / moved_gb}
    if all(len(s) > 2 for s in samples):
        row["target_cpu_s_per_gb"] = sum(s[2] for s in samples) / moved_gb
    return row


def memcpy_row(size: int, n: int) -> dict[str, float]:
    src, dst = np.ones(size, dtype=np.uint8), np.empty(size, dtype=np.uint8)

    def one_pass() -> None:
        for _ in range(n):
            np.copyto(dst, src)

    return measure(one_pass, n * size, n)


@contextlib.contextmanager
def socket_pair(family: socket.AddressFamily) -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected stream pair (client, server end) on 127.0.0.1 or a Unix socket in a temp dir."""
    tmp = tempfile.mkdtemp(prefix="kvpool-bench-sock-")
    listener = socket.socket(family, socket.SOCK_STREAM)
    client = socket.socket(family, socket.SOCK_STREAM)
    server: socket.socket | None = None
    try:
        for s in (listener, client):  # before connect, so TCP scales its window to them
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        where: Any = os.path.join(tmp, "s") if family == socket.AF_UNIX else ("127.0.0.1", 0)
        listener.bind(where)
        listener.listen(1)
        client.connect(listener.getsockname())
        server, _ = listener.accept()
        yield client, server
    finally:
        for sock in (client, server, listener):
            if sock is not None:
                sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(tmp, "s"))
        os.rmdir(tmp)


def socket_row(family: socket.AddressFamily, size: int, n: int) -> dict[str, float]:
    """A sender thread sends ``n`` messages of ``size`` bytes per pass (started by one byte from the
    receiver); the receiver ``recv_into``s each into one preallocated buffer.  Both sides in this process."""
    with socket_pair(family) as (receiver, sender):

        def send() -> None:
            data = np.ones(size, dtype=np.uint8).data
            while sender.recv(1):
                for _ in range(n):
                    sender.sendall(data)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        buf = np.empty(size, dtype=np.uint8)
        view = buf.data

        def one_pass() -> None:
            receiver.sendall(b"g")
            for _ in range(n):
                got = 0
                while got < size:
                    k = receiver.recv_into(view[got:], size - got)
                    if not k:
                        raise ConnectionError("sender closed the socket")
                    got += k

        try:
            return measure(one_pass, n * size, n)
        finally:
            receiver.shutdown(socket.SHUT_WR)  # the sender's recv sees EOF and the thread ends
            thread.join(timeout=10)


def transfer_limits(sizes: list[int], total: int) -> dict[str, list[dict[str, Any]]]:
    """memcpy, TCP and Unix-socket rows for each value size, ``total`` bytes moved per row."""
    rows: dict[str, list[dict[str, Any]]] = {"memcpy": [], "tcp_socket": [], "unix_socket": []}
    for size in sizes:
        n = max(1, total // size)
        rows["memcpy"].append({"size_mib": size // MiB, **memcpy_row(size, n)})
        rows["tcp_socket"].append({"size_mib": size // MiB, **socket_row(socket.AF_INET, size, n)})
        rows["unix_socket"].append({"size_mib": size // MiB, **socket_row(socket.AF_UNIX, size, n)})
    return rows
