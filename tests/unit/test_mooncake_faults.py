"""The chaos bench's faults on Mooncake Store: a byte flip written into another process's segment through
/proc/PID/mem, and the kinds a Mooncake run takes."""

import sys
import time
from pathlib import Path

import pytest

from kvpool.bench.serving import mooncake_faults
from kvpool.bench.serving.layers import Server
from kvpool.errors import ConfigError
from kvpool.servers.process import ServerProcess

SEGMENT = 24 << 20
#: a stand-in holder: a zeroed anonymous segment; once ``go`` exists it writes how many of its bytes are not zero
HOLDER = f"""
import mmap, pathlib, sys, time
seg = mmap.mmap(-1, {SEGMENT})
work = pathlib.Path(sys.argv[1])
(work / "ready").touch()
while not (work / "go").exists():
    time.sleep(0.05)
(work / "count").write_text(str({SEGMENT} - seg[:].count(0)))
time.sleep(60)
"""


def test_a_byte_flip_lands_once_in_every_flip_every_bytes_of_the_holder_s_segment(tmp_path: Path) -> None:
    proc = ServerProcess("holder", [sys.executable, "-c", HOLDER, str(tmp_path)], tmp_path / "holder.log")
    proc.start(lambda: None if (tmp_path / "ready").exists() else "no segment yet", 60, ConfigError)
    try:
        victim = mooncake_faults.StoreVictim({mooncake_faults.HOLDER: Server(proc, lambda: None)}, proc, SEGMENT)
        flip = mooncake_faults.fault("byte-flip", victim, 5.0)
        flip.inject()
        (tmp_path / "go").touch()
        deadline = time.monotonic() + 60
        while not (tmp_path / "count").exists():
            assert time.monotonic() < deadline and proc.running(), (tmp_path / "holder.log").read_text()
            time.sleep(0.05)
        assert int((tmp_path / "count").read_text()) == SEGMENT // mooncake_faults.FLIP_EVERY
        assert f"{SEGMENT // mooncake_faults.FLIP_EVERY} bytes flipped" in flip.outcome()
    finally:
        proc.stop()


def test_a_kind_the_store_has_no_counterpart_for_or_a_server_it_lacks_is_a_config_error() -> None:
    victim = mooncake_faults.StoreVictim({}, ServerProcess("engine", ["true"], Path("/dev/null")), SEGMENT)
    with pytest.raises(ConfigError, match="full-pool"):
        mooncake_faults.fault("full-pool", victim, 8.0)
    with pytest.raises(ConfigError, match="runs no mooncake_master"):
        mooncake_faults.fault("master-kill", victim, 8.0)
