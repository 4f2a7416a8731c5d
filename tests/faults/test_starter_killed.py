"""``kvpool up --hold`` killed with SIGKILL, as an OOM kill or a CI timeout kills it, runs no exit code of its own; it
leaves nothing behind all the same: its watchdog (``kvpool/servers/watchdog.py``) stops etcd and the Ray node with
every process they started, then removes the pool node's segment files and the servers' temp folders, and ends."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvpool.core.procs import proc_stat
from kvpool.metadata.config import ENDPOINTS_ENV

pytestmark = pytest.mark.timeout(600)


def started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot); None once it is gone (a zombie is gone)."""
    fields = proc_stat(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def below(root: int) -> dict[int, int]:
    """Every live process descended from ``root``: pid -> when it started."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))) is not None:
            parents[int(entry.name)] = int(fields[1])
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found.update((pid, t) for pid in children if (t := started(pid)) is not None)
        frontier = children
    return found


#: a pool node's DRAM segment file or NVMe temp folder: ``kvpool-[nvme-]<node id's first 16>-<its pid>...``
SEGMENT = re.compile(r"^kvpool-(?:nvme-)?[0-9a-f]{16}-(\d+)\b")


def segment_files(pids: set[int]) -> list[Path]:
    """The DRAM segment files and NVMe temp folders of pool nodes among ``pids``."""
    places = [*Path("/dev/shm").glob("kvpool-*"), *Path(tempfile.gettempdir()).glob("kvpool-nvme-*")]
    return [p for p in places if (m := SEGMENT.match(p.name)) and int(m[1]) in pids]


def test_kvpool_up_killed_with_sigkill_leaves_no_process_and_no_segment(tmp_path: Path) -> None:
    log = tmp_path / "up.log"
    kvpool = str(Path(sys.executable).with_name("kvpool"))
    args = [kvpool, "up", "--hold", "--nodes", "1", "--dram-mib", "64", "--nvme-mib", "64", "--demo", "none"]
    env = {k: v for k, v in os.environ.items() if k not in (ENDPOINTS_ENV, "RAY_ADDRESS")} | {"COLUMNS": "400"}
    with log.open("w") as out:
        up = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "Ctrl-C" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        left = below(up.pid)  # etcd, the Ray node and its processes (the PoolNode among them), the watchdog
        segments = segment_files(set(left))
        # its etcd's data and its Ray cluster's logs and token, as it printed them
        folders = {Path(f).parent for f in re.findall(r"/tmp/kvpool-(?:etcd|ray)-\w+/\w+", log.read_text())}
        assert len(left) > 5 and segments and len(folders) == 2, (left, segments, folders)
    finally:
        os.kill(up.pid, signal.SIGKILL)
        up.wait()
    deadline = time.monotonic() + 120
    while True:
        alive = {pid for pid, t in left.items() if started(pid) == t}
        stayed = [*segment_files(set(left)), *(f for f in folders if f.exists())]
        if not alive and not stayed:
            break
        if time.monotonic() > deadline:
            for pid in alive:  # not to leave them to the next test
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"still there 120 s after: processes {sorted(alive)}, files {stayed}")
        time.sleep(0.5)
