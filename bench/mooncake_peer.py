"""Mooncake Store over TCP, the benchmark peer of ``bench/transfer.py`` (not a kvpool dependency; nothing here
installs it): a ``mooncake_master`` and two store clients as separate processes in a private network namespace,
client B putting values onto client A's segment and getting them back.  (Not named ``mooncake.py``: run as a
script, ``bench/`` comes first on ``sys.path`` and that name would hide the ``mooncake`` package.)"""

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
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.console import Console

from kvpool.bench.children import SCRIPT, progress, run_child, stop_process
from kvpool.bench.limits import REPEAT, cell, proc_cpu_s
from kvpool.core.net import free_port
from kvpool.pool.config import MiB

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
        [
            sys.executable,
            "-m",
            "mooncake.cli",  # execs the wheel's mooncake_master binary
            f"--rpc_address={MOONCAKE_MASTER}",
            f"--rpc_port={port}",
            f"--metrics_host={MOONCAKE_MASTER}",
            f"--metrics_port={free_port(MOONCAKE_MASTER)}",
        ],
        stdout=log,
        stderr=log,
        env=env,
        preexec_fn=die_with_parent,
    )
    stack.callback(stop_process, master)
    wait_listening(MOONCAKE_MASTER, port, master)
    return f"{MOONCAKE_MASTER}:{port}"


def start_mooncake_holder(
    stack: contextlib.ExitStack, log: Any, env: dict[str, str], address: str, capacity: int
) -> tuple[subprocess.Popen[str], str]:
    """Client A, a process of this script (stopped when ``stack`` closes); returns it and its segment's name."""
    holder = subprocess.Popen(
        [sys.executable, SCRIPT, "--_mooncake_holder", address, str(capacity)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**env, "MC_TCP_BIND_ADDRESS": MOONCAKE_HOLDER},
        preexec_fn=die_with_parent,
    )
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
        return {
            "status": "Mooncake Store comparison skipped: it runs in a private network namespace and needs "
            "`unshare` (util-linux)"
        }
    cmd = [
        "unshare",
        "--net",
        *([] if os.geteuid() == 0 else ["--map-root-user"]),
        sys.executable,
        SCRIPT,
        "--_mooncake",
        "--sizes",
        args.sizes,
        "--mib-per-size",
        str(args.mib_per_size),
    ]
    try:
        result = run_child(cmd, dict(os.environ), "Mooncake Store", console)
    except RuntimeError as e:
        return {"status": f"Mooncake Store comparison failed: {e}"}
    if "skipped" in result:
        return {"status": result["skipped"]}
    return {"status": f"Mooncake Store measured ({result['seconds']:.0f} s)", **result}
