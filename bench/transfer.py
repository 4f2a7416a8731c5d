"""Transfer throughput: raw NIXL READ/WRITE and the pool's cross-node get/put, beside this machine's limits.

For each value size (1, 4, 16, 64 MiB) it prints one table of GB/s, with operations/s and CPU-seconds
per GB under each figure:

- the limits of this machine, measured in the same run: one-thread memcpy (``np.copyto``), a raw TCP
  loopback socket and a raw Unix-domain socket (4 MiB socket buffers, ``recv_into`` a preallocated buffer);
- raw NIXL: one-sided READ and WRITE of one value per call between two processes (``NixlTransport``; the
  target serves a ``DramSegment`` registered as ``dram0``);
- the pool: a ``PoolClient`` on the second node of a local 2-node Ray cluster puts values onto the head
  node's ``PoolNode`` (NIXL WRITE) and reads them back with ``get_into_batch`` (NIXL READ, crc checked).

The NIXL and pool rows run twice, each in a fresh process of this script (UCX reads its environment when
an agent starts): with kvpool's default ``UCX_TLS=posix,cma,tcp`` and with ``UCX_TLS=tcp``, both with
``UCX_NET_DEVICES=lo``.  A Mooncake Store comparison is skipped (reported) unless ``mooncake`` imports.

    python bench/transfer.py [--sizes 1,4,16,64] [--mib-per-size 128] [--json bench/results/transfer.json]
"""

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

MiB = 1 << 20
REPEAT = 3  #: timed passes per cell; the median is reported
SOCKET_BUFFER = 4 * MiB  #: SO_SNDBUF / SO_RCVBUF of the raw sockets (the kernel caps it at [wr]mem_max)
TARGET_MIN_BYTES = 160 * MiB  #: the raw NIXL target's segment (at least two of the largest values)
WORKER_TIMEOUT_S = 240
SETTINGS = {  # name -> (label, UCX environment)
    "default": ("posix,cma,tcp", {"UCX_TLS": "posix,cma,tcp", "UCX_NET_DEVICES": "lo"}),
    "tcp": ("tcp", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}),
}
SCRIPT = str(Path(__file__).resolve())


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


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


# -- the limits of this machine ---------------------------------------------------------------------------


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


def limits(sizes: list[int], total: int) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {"memcpy": [], "tcp_socket": [], "unix_socket": []}
    for size in sizes:
        n = max(1, total // size)
        rows["memcpy"].append({"size_mib": size // MiB, **memcpy_row(size, n)})
        rows["tcp_socket"].append({"size_mib": size // MiB, **socket_row(socket.AF_INET, size, n)})
        rows["unix_socket"].append({"size_mib": size // MiB, **socket_row(socket.AF_UNIX, size, n)})
    return rows


# -- raw NIXL: a target process serving a DramSegment, this process initiating -----------------------------


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
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
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


# -- the pool: remote put and get between the two nodes of a local Ray cluster -----------------------------


def pool_rows(sizes: list[int], total: int) -> list[dict[str, Any]]:
    import ray

    from kvpool.metadata.config import MetadataConfig
    from kvpool.metadata.etcd_server import EmbeddedEtcd
    from kvpool.pool.client import PoolClient
    from kvpool.pool.config import PoolConfig
    from kvpool.pool.keys import CacheIdentity, chunk_keys
    from kvpool.pool.local_cluster import LocalRayCluster
    from kvpool.pool.node import start_pool, stop_pool

    ident = CacheIdentity(model="bench-transfer", kv_dtype="uint8", layout="bytes", chunk_size=1)

    @ray.remote(num_cpus=0)
    class RemoteSide:
        """A client on the second node: puts onto the head node, and reads those chunks back from there."""

        def __init__(self, config: PoolConfig) -> None:
            self.client = PoolClient(config)

        def ucx_tls(self) -> str:
            return os.environ.get("UCX_TLS", "")

        def put(self, keys: list[bytes], size: int, nodes: list[str]) -> tuple[float, float]:
            data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
            t0, c0 = time.perf_counter(), time.process_time()
            self.client.put_batch([(k, data) for k in keys], nodes=nodes)
            return time.perf_counter() - t0, time.process_time() - c0

        def get(self, keys: list[bytes], size: int, batch: int) -> tuple[float, float]:
            bufs = [np.empty(size, dtype=np.uint8) for _ in range(min(batch, len(keys)))]
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(0, len(keys), len(bufs)):
                chunk = keys[i : i + len(bufs)]
                self.client.get_into_batch(chunk, bufs[: len(chunk)])
            return time.perf_counter() - t0, time.process_time() - c0

        def remove(self, keys: list[bytes]) -> None:
            for k in keys:
                self.client.remove(k)

        def close(self) -> None:
            self.client.close()

    def cell(samples: list[tuple[float, float]], nbytes: int, ops: int) -> dict[str, float]:
        median = statistics.median(s for s, _ in samples)
        cpu = sum(c for _, c in samples) / (len(samples) * nbytes / 1e9)
        return {"gbps": gbps(nbytes, median), "ops_s": ops / median, "cpu_s_per_gb": cpu}

    rows: list[dict[str, Any]] = []
    with EmbeddedEtcd() as etcd, LocalRayCluster(nodes=2) as cluster:
        head, second = cluster.node_ids()
        config = PoolConfig(
            metadata=MetadataConfig(endpoints=(etcd.endpoint,), cluster="bench-transfer"),
            dram_bytes=total + 256 * MiB, nvme_bytes=-1, namespace=f"bench-{uuid.uuid4().hex[:6]}",
        )  # fmt: skip
        remote = None
        try:
            start_pool(config)
            affinity = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(second, soft=False)
            remote = RemoteSide.options(scheduling_strategy=affinity).remote(config)
            seen = ray.get(remote.ucx_tls.remote())
            if seen != os.environ["UCX_TLS"]:
                raise RuntimeError(f"the Ray workers see UCX_TLS={seen!r}, not {os.environ['UCX_TLS']!r}")
            for size in sizes:
                n = max(1, total // size)
                keys = chunk_keys(ident, np.arange(n) + size)  # distinct keys per size
                warm = chunk_keys(ident, np.arange(1) + 10_000 + size)
                ray.get(remote.put.remote(warm, size, [head]))  # connects, registers the staging buffer
                ray.get(remote.get.remote(warm, size, 8))
                ray.get(remote.remove.remote(warm))
                puts = []
                for rep in range(REPEAT):  # keys name content: a stored key is not written again
                    puts.append(ray.get(remote.put.remote(keys, size, [head])))
                    if rep < REPEAT - 1:
                        ray.get(remote.remove.remote(keys))
                gets = [ray.get(remote.get.remote(keys, size, 8)) for _ in range(REPEAT)]
                ray.get(remote.remove.remote(keys))
                rows.append({"size_mib": size // MiB, "op": "put", **cell(puts, n * size, n)})
                rows.append({"size_mib": size // MiB, "op": "get", **cell(gets, n * size, n)})
                progress(f"pool {size // MiB} MiB done")
        finally:
            if remote is not None:
                with contextlib.suppress(Exception):
                    ray.get(remote.close.remote(), timeout=30)
                ray.kill(remote)
            stop_pool(config)
    return rows


def progress(message: str) -> None:
    print("PROGRESS", message, flush=True)


def run_worker(setting: str, sizes: list[int], total: int) -> None:
    """``--_worker``: the NIXL and pool rows under the UCX environment the parent set; one RESULT line."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout in the parent: run the finally blocks
    t0 = time.perf_counter()
    result: dict[str, Any] = {"setting": setting, "ucx_tls": os.environ.get("UCX_TLS", "")}
    result["nixl"] = nixl_rows(sizes, total)
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
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        timer = threading.Timer(WORKER_TIMEOUT_S, proc.terminate)  # SIGTERM: the worker stops what it started
        timer.start()
        result = None
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("PROGRESS "):
                    console.print(f"  UCX_TLS={SETTINGS[setting][0]}: {line[9:].strip()}", markup=False)
                elif line.startswith("RESULT "):
                    result = json.loads(line[7:])
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if result is None:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"the {setting} worker exited with {proc.returncode} and no result:\n{tail}")
    return result


def mooncake_status() -> str:
    if importlib.util.find_spec("mooncake") is None:
        return (
            "Mooncake comparison skipped: the 'mooncake' module is not installed (it needs Debian's libibverbs1 "
            "and librdmacm1, then `pip install mooncake-transfer-engine-non-cuda`)"
        )
    return "Mooncake comparison skipped: 'mooncake' is installed, but this benchmark has no Mooncake Store path yet"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16,64", help="value sizes in MiB (default 1,4,16,64)")
    ap.add_argument("--mib-per-size", type=int, default=128, help="bytes moved per measurement, MiB (default 128)")
    ap.add_argument("--json", default="bench/results/transfer.json", help="where to write the figures")
    ap.add_argument("--_worker", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    ap.add_argument("--_target", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._target:
        run_target(args._target)
        return
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    total = args.mib_per_size * MiB
    if args._worker:
        run_worker(args._worker, sizes, total)
        return

    console = Console()
    console = Console(width=max(console.width, 140))  # four size columns: 80 (a pipe's default) is too narrow
    t0 = time.perf_counter()
    floor = limits(sizes, total)
    console.print("machine limits measured")
    workers = {setting: spawn_worker(setting, args, console) for setting in SETTINGS}
    mooncake = mooncake_status()

    table = Table(
        title=f"kvpool transfers, GB/s ({args.mib_per_size} MiB moved per cell, median of {REPEAT} passes)",
        caption="under each figure: operations/s · CPU-seconds per GB (sockets: both ends, one process; NIXL: "
        "initiator + target; pool: the client only)\npool: a client on node 2 puts to / gets from the pool node "
        "on node 1 (NIXL WRITE / READ plus crc32c, Ray and etcd calls)",
    )
    table.add_column("path")
    table.add_column("UCX_TLS")
    for size in sizes:
        table.add_column(f"{size // MiB} MiB", justify="right")

    def by_size(rows: list[dict[str, Any]], **match: str) -> list[dict[str, Any] | None]:
        found = {r["size_mib"]: r for r in rows if all(r.get(k) == v for k, v in match.items())}
        return [found.get(size // MiB) for size in sizes]

    table.add_row("memcpy (np.copyto, 1 thread)", "", *(fmt(c) for c in by_size(floor["memcpy"])))
    table.add_row("TCP socket 127.0.0.1", "", *(fmt(c) for c in by_size(floor["tcp_socket"])))
    table.add_row("Unix socket", "", *(fmt(c) for c in by_size(floor["unix_socket"])), end_section=True)
    for part, ops, name in (
        ("nixl", ("READ", "WRITE"), "NIXL {op}, 2 processes"),
        ("pool", ("get", "put"), "pool remote {op}"),
    ):
        for op in ops:
            for setting, result in workers.items():
                table.add_row(name.format(op=op), SETTINGS[setting][0], *(fmt(c) for c in by_size(result[part], op=op)))
        table.rows[-1].end_section = True
    console.print(table)
    console.print(mooncake)
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
