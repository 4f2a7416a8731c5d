"""A Ray node of its own, joined to the session's test cluster and killed whole (a power cut): for the fault tests."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import ray

from kvpool.pool.config import MiB
from kvpool.servers.ray_cluster import RAY_ENV


@contextlib.contextmanager
def extra_ray_node(ip: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """A Ray node on ``ip`` joined to the session's cluster, and a function that kills it whole: every
    process carrying its environment marker (``ray start``, raylet, object store, workers)."""
    marker = uuid.uuid4().hex
    gcs = ray.get_runtime_context().gcs_address
    args = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        f"--address={gcs}",
        f"--node-ip-address={ip}",
        "--num-cpus=1",
        f"--object-store-memory={96 * MiB}",
        "--dashboard-agent-listen-port=0",
        "--disable-usage-stats",
        "--block",
    ]
    env = {**os.environ, **RAY_ENV, "KVPOOL_FAULT_NODE": marker}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def kill() -> None:
        for pid in _pids_with(f"KVPOOL_FAULT_NODE={marker}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    try:
        deadline = time.monotonic() + 120
        while not (node := next((n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip), None)):
            assert proc.poll() is None and time.monotonic() < deadline, f"Ray node {ip} did not join"
            time.sleep(0.2)
        yield node["NodeID"], kill
    finally:
        kill()
        proc.wait(timeout=30)


def _pids_with(entry: str) -> list[int]:
    """Processes whose environment holds ``entry`` (``NAME=value``)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.encode() in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
    return pids
