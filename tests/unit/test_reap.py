import os
import subprocess
import sys
from pathlib import Path

from kvpool.pool.segment import reap_stale_segments


def test_reaps_only_what_dead_pool_nodes_left(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(dead.stdout), os.getpid()
    names = {
        f"kvpool-0123456789abcdef-{dead_pid}.seg": False,
        f"kvpool-0123456789abcdef-{dead_pid}.nvme": False,
        f"kvpool-0123456789abcdef-{live_pid}.seg": True,
        "kvpool-etcd-abc": True,  # not a segment: never touched
        "unrelated.seg": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f"kvpool-nvme-0123456789abcdef-{dead_pid}-x1y2").mkdir()
    reap_stale_segments(str(tmp_path))
    assert {p.name for p in tmp_path.iterdir()} == {n for n, kept in names.items() if kept}
