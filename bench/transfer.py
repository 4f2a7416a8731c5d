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
import contextlib
import ctypes
import fcntl
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
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


def cell(samples: Sequence[Sequence[float]], nbytes: int, ops: int) -> dict[str, float]:
    """GB/s and ops/s of the median pass, from timed passes that each moved ``nbytes`` in ``ops`` operations:
    ``(wall seconds, CPU seconds[, the target's CPU seconds])``; CPU-seconds per GB over all passes."""
    median = statistics.median(s[0] for s in samples)
    moved_gb = len(samples) * nbytes / 1e9
    row = {"gbps": gbps(nbytes, median), "ops_s": ops / median, "cpu_s_per_gb": sum(s[1] for s in samples) / moved_gb}
    if all(len(s) > 2 for s in samples):
        row["target_cpu_s_per_gb"] = sum(s[2] for s in samples) / moved_gb
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
            dram_bytes=total + 256 * MiB, nvme_bytes=-1, namespace=f"bench-{uuid.uuid4().hex[:6]}",
        )  # fmt: skip
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

    from kvpool.pool.keys import CacheIdentity, chunk_keys

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


def run_child(cmd: list[str], env: dict[str, str], label: str, console: Console) -> dict[str, Any]:
    """Run a worker of this script, echo its ``PROGRESS`` lines and return its ``RESULT``; stop it after
    ``WORKER_TIMEOUT_S`` (SIGTERM, so it stops what it started; SIGKILL 90 s later)."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        timer = threading.Timer(WORKER_TIMEOUT_S, proc.terminate)
        timer.start()
        result = None
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("PROGRESS "):
                    console.print(f"  {label}: {line[9:].strip()}", markup=False)
                elif line.startswith("RESULT "):
                    result = json.loads(line[7:])
            proc.wait()
        finally:
            timer.cancel()
            stop_process(proc, grace_s=90)
        if result is None:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"the {label} worker exited with {proc.returncode} and no result:\n{tail}")
    return result


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


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 15, quit_stdin: bool = False) -> None:
    """Stop a child: ``quit`` on its stdin (if asked) or SIGTERM, then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        if quit_stdin and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.write("quit\n")
                proc.stdin.close()
        else:
            proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- Mooncake Store (a benchmark peer, not a kvpool dependency) ---------------------------------------------

MOONCAKE_MASTER = "127.0.0.1"
MOONCAKE_HOLDER = "127.0.0.2"  #: client A: mounts the segment that holds the values
MOONCAKE_READER = "127.0.0.3"  #: client B: puts the values onto A's segment and gets them back
MOONCAKE_READER_SEGMENT = 64 * MiB  #: B's own segment (the values must not land there; checked)
MOONCAKE_BATCH = 8  #: values per batch_put_from / batch_get_into call, as in the pool's get
MOONCAKE_INSTALL = (
    "to include it, install Mooncake beside kvpool (a benchmark peer, not a kvpool dependency): Debian's "
    "`apt-get install libibverbs1 librdmacm1` (needed even for TCP), then `pip install "
    "mooncake-transfer-engine-non-cuda` into this environment"
)


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGKILL when its parent dies (PR_SET_PDEATHSIG; kept across exec)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def loopback_namespace() -> None:
    """Check that this process is in a network namespace with no interface but ``lo`` (``unshare --net``),
    and bring ``lo`` up (SIOCGIFFLAGS / SIOCSIFFLAGS with IFF_UP)."""
    names = sorted(name for _, name in socket.if_nameindex())
    if names != ["lo"]:
        raise RuntimeError(f"not in a private network namespace: interfaces {names}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 0x1))


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_listening(host: str, port: int, proc: subprocess.Popen[Any], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")
        time.sleep(0.1)
    raise RuntimeError(f"mooncake_master exited with {proc.returncode}")


def run_mooncake_holder(master: str, capacity: int) -> None:
    """``--_mooncake_holder``: client A mounts a ``capacity``-byte segment, prints ``SEGMENT <name>`` and
    serves it until EOF or ``quit`` on stdin."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(MOONCAKE_HOLDER, "P2PHANDSHAKE", capacity, 16 * MiB, "tcp", "", master)
    try:
        if rc:
            raise RuntimeError(f"the holder's MooncakeDistributedStore.setup returned {rc}")
        print("SEGMENT", store.get_hostname(), flush=True)
        for line in sys.stdin:
            if line.strip() == "quit":
                break
    finally:
        store.close()


def run_mooncake(sizes: list[int], total: int) -> None:
    """``--_mooncake`` (in a private network namespace): start ``mooncake_master`` and client A, be client B
    and measure; one RESULT line (``skipped`` if ``mooncake.store`` does not import)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout in the parent: run the finally blocks
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa: F401
    except ImportError as e:
        skipped = f"Mooncake Store comparison skipped: mooncake.store does not import ({e}); {MOONCAKE_INSTALL}"
        print("RESULT", json.dumps({"skipped": skipped}), flush=True)
        return
    loopback_namespace()
    t0 = time.perf_counter()
    env = {**os.environ, "GLOG_minloglevel": "1"}  # Mooncake logs every connection at INFO
    capacity = 2 * total + 2 * max(sizes)  # the values of one size stay well under its eviction watermark
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryFile() as log, contextlib.ExitStack() as stack:
        try:
            address = start_mooncake_master(stack, log, env)
            holder, segment = start_mooncake_holder(stack, log, env, address, capacity)
            batch_bytes = max(min(MOONCAKE_BATCH, max(1, total // size)) * size for size in sizes)
            store, src, dst = mooncake_reader(stack, address, batch_bytes)
            for size in sizes:
                rows += mooncake_cells(store, segment, holder.pid, src, dst, size, total)
                progress(f"{size // MiB} MiB done")
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-3000:])
            raise
    print("RESULT", json.dumps({"rows": rows, "seconds": time.perf_counter() - t0}), flush=True)


def start_mooncake_master(stack: contextlib.ExitStack, log: Any, env: dict[str, str]) -> str:
    """``mooncake_master`` on ``MOONCAKE_MASTER`` (stopped when ``stack`` closes); returns its ``host:port``."""
    port = free_port(MOONCAKE_MASTER)
    master = subprocess.Popen(
        [sys.executable, "-m", "mooncake.cli",  # execs the wheel's mooncake_master binary
         f"--rpc_address={MOONCAKE_MASTER}", f"--rpc_port={port}",
         f"--metrics_host={MOONCAKE_MASTER}", f"--metrics_port={free_port(MOONCAKE_MASTER)}"],
        stdout=log, stderr=log, env=env, preexec_fn=die_with_parent,
    )  # fmt: skip
    stack.callback(stop_process, master)
    wait_listening(MOONCAKE_MASTER, port, master)
    return f"{MOONCAKE_MASTER}:{port}"


def start_mooncake_holder(
    stack: contextlib.ExitStack, log: Any, env: dict[str, str], address: str, capacity: int
) -> tuple[subprocess.Popen[str], str]:
    """Client A, a process of this script (stopped when ``stack`` closes); returns it and its segment's name."""
    holder = subprocess.Popen(
        [sys.executable, SCRIPT, "--_mooncake_holder", address, str(capacity)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
        env={**env, "MC_TCP_BIND_ADDRESS": MOONCAKE_HOLDER}, preexec_fn=die_with_parent,
    )  # fmt: skip
    stack.callback(stop_process, holder, quit_stdin=True)
    assert holder.stdout is not None
    segment = next((line.split()[1] for line in holder.stdout if line.startswith("SEGMENT ")), "")
    if not segment:
        raise RuntimeError(f"the Mooncake holder exited ({holder.wait()}) without a segment")
    return holder, segment


def mooncake_reader(stack: contextlib.ExitStack, address: str, nbytes: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """Client B in this process (closed when ``stack`` closes), with a registered source and destination buffer
    of ``nbytes`` each."""
    from mooncake.store import MooncakeDistributedStore

    os.environ["MC_TCP_BIND_ADDRESS"] = MOONCAKE_READER  # read by setup
    store = MooncakeDistributedStore()
    stack.callback(store.close)
    rc = store.setup(MOONCAKE_READER, "P2PHANDSHAKE", MOONCAKE_READER_SEGMENT, 16 * MiB, "tcp", "", address)
    if rc:
        raise RuntimeError(f"the reader's MooncakeDistributedStore.setup returned {rc}")
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)  # pages faulted in now, not in the first get
    for buf in (src, dst):
        if store.register_buffer(buf.ctypes.data, buf.nbytes):
            raise RuntimeError("MooncakeDistributedStore.register_buffer failed")
        stack.callback(store.unregister_buffer, buf.ctypes.data)
    return store, src, dst


class MooncakeBatches:
    """Client B's batched calls for one value size: ``MOONCAKE_BATCH`` values a call, put from ``src`` onto the
    holder's segment and read back into ``dst``, each return code checked."""

    def __init__(self, store: Any, segment: str, src: np.ndarray, dst: np.ndarray, size: int, batch: int) -> None:
        from mooncake.store import ReplicateConfig

        self.store, self.src, self.dst, self.size, self.batch = store, src, dst, size, batch
        self.config = ReplicateConfig()
        self.config.replica_num = 1
        self.config.preferred_segment = segment

    def _each_batch(self, call: Callable[..., list[int]], buf: np.ndarray, ks: list[str], *extra: Any) -> list[int]:
        codes: list[int] = []
        for i in range(0, len(ks), self.batch):
            chunk = ks[i : i + self.batch]
            ptrs = [buf.ctypes.data + j * self.size for j in range(len(chunk))]
            codes += call(chunk, ptrs, [self.size] * len(chunk), *extra)
        return codes

    def put(self, ks: list[str]) -> None:
        codes = self._each_batch(self.store.batch_put_from, self.src, ks, self.config)
        if any(codes):
            raise RuntimeError(f"batch_put_from returned {sorted(set(codes))}")

    def get(self, ks: list[str]) -> None:
        codes = self._each_batch(self.store.batch_get_into, self.dst, ks)
        if any(c != self.size for c in codes):
            raise RuntimeError(f"batch_get_into returned {sorted(set(codes))}, not {self.size}")

    def remove(self, ks: list[str]) -> None:
        codes = self.store.batch_remove(ks, True)  # force: a get leaves a lease on the value
        if any(codes):
            raise RuntimeError(f"batch_remove returned {sorted(set(codes))}")

    def check_on_holder(self, ks: list[str]) -> None:
        """Every value is in the holder's memory (endpoints: host:port of the holding client's transport)."""
        descs = self.store.batch_get_replica_desc(ks)
        hosts = {
            r.get_memory_descriptor().buffer_descriptor.transport_endpoint.rsplit(":", 1)[0]
            if r.is_memory_replica()
            else "disk"
            for k in ks
            for r in descs[k]
        }
        if hosts != {MOONCAKE_HOLDER}:
            raise RuntimeError(f"the values landed on {sorted(hosts)}, not only on the holder ({MOONCAKE_HOLDER})")


def mooncake_cells(
    store: Any, segment: str, holder_pid: int, src: np.ndarray, dst: np.ndarray, size: int, total: int
) -> list[dict[str, Any]]:
    """Client B's put and get rows for one value size: ``REPEAT`` timed put passes (the keys removed between
    them: a key is not put twice), then ``REPEAT`` timed get passes; the last get's bytes checked."""
    n = max(1, total // size)
    calls = MooncakeBatches(store, segment, src, dst, size, min(MOONCAKE_BATCH, n))
    keys = [f"bench-{size}-{i}" for i in range(n)]

    def timed(step: Callable[[list[str]], None]) -> tuple[float, float, float]:
        t0, c0, h0 = time.perf_counter(), time.process_time(), proc_cpu_s(holder_pid)
        step(keys)
        return time.perf_counter() - t0, time.process_time() - c0, proc_cpu_s(holder_pid) - h0

    warm = [f"warm-{size}"]  # connects (first size) and touches the segment's allocator
    calls.put(warm)
    calls.get(warm)
    calls.remove(warm)
    puts = []
    for rep in range(REPEAT):
        puts.append(timed(calls.put))
        if rep == 0:
            calls.check_on_holder(keys)
        if rep < REPEAT - 1:
            calls.remove(keys)
    gets = [timed(calls.get) for _ in range(REPEAT)]
    last = n - (n - 1) // calls.batch * calls.batch  # values in the last batch, read into dst[: last * size]
    if not np.array_equal(dst[: last * size], src[: last * size]):
        raise RuntimeError(f"batch_get_into returned other bytes than were put ({size // MiB} MiB values)")
    calls.remove(keys)
    return [
        {"size_mib": size // MiB, "op": "put", **cell(puts, n * size, n)},
        {"size_mib": size // MiB, "op": "get", **cell(gets, n * size, n)},
    ]


def mooncake_figures(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The Mooncake rows, or why there are none (``status``)."""
    if importlib.util.find_spec("mooncake") is None:
        return {
            "status": f"Mooncake Store comparison skipped: the 'mooncake' module is not installed; {MOONCAKE_INSTALL}"
        }
    if shutil.which("unshare") is None:
        return {"status": "Mooncake Store comparison skipped: it runs in a private network namespace and needs "
                "`unshare` (util-linux)"}  # fmt: skip
    cmd = [
        "unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]),
        sys.executable, SCRIPT, "--_mooncake", "--sizes", args.sizes, "--mib-per-size", str(args.mib_per_size),
    ]  # fmt: skip
    try:
        result = run_child(cmd, dict(os.environ), "Mooncake Store", console)
    except RuntimeError as e:
        return {"status": f"Mooncake Store comparison failed: {e}"}
    if "skipped" in result:
        return {"status": result["skipped"]}
    return {"status": f"Mooncake Store measured ({result['seconds']:.0f} s)", **result}


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
    floor: dict[str, list[dict[str, Any]]], workers: dict[str, dict[str, Any]], mooncake: dict[str, Any],
    sizes: list[int], mib_per_size: int,
) -> Table:  # fmt: skip
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
    floor = limits(sizes, total)
    console.print("machine limits measured")
    workers = {setting: spawn_worker(setting, args, console) for setting in SETTINGS}
    mooncake = mooncake_figures(args, console)
    console.print(render(floor, workers, mooncake, sizes, args.mib_per_size))
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
