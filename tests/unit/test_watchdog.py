"""The watchdog (kvpool/servers/watchdog.py) with real processes and no servers: a starter guards a session of its
own children, lets go of another, names an end command, and is killed with SIGKILL; the guarded session goes whole
(its grandchildren too), the released one stays, and the end command runs."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.servers import watchdog

STARTER = textwrap.dedent(
    """
    import subprocess, sys, time
    from kvpool.servers import watchdog

    guarded = subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600"], start_new_session=True)
    watchdog.guard(guarded.pid)
    released = subprocess.Popen(["sleep", "600"], start_new_session=True)
    watchdog.guard(released.pid)
    watchdog.release(released.pid)
    end = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('ended')"
    watchdog.at_end([sys.executable, "-c", end, sys.argv[1]])
    print(guarded.pid, released.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_killed_starter_s_guarded_sessions_go_and_its_end_command_runs(tmp_path: Path) -> None:
    ended = tmp_path / "ended"
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(ended)], stdout=subprocess.PIPE, text=True)
    assert starter.stdout is not None
    guarded, released = map(int, starter.stdout.readline().split())
    try:
        deadline = time.monotonic() + 30
        while len(watchdog.session_members({guarded})) < 3:  # sh and its two sleeps
            assert time.monotonic() < deadline, watchdog.session_members({guarded})
            time.sleep(0.05)
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 60
        while watchdog.session_members({guarded}) or not ended.exists():
            assert time.monotonic() < deadline, (watchdog.session_members({guarded}), ended.exists())
            time.sleep(0.05)
        assert ended.read_text() == "ended" and watchdog.session_members({released}) == [released]
    finally:
        for pid in watchdog.session_members({guarded, released}):
            os.kill(pid, signal.SIGKILL)


def test_an_end_command_is_a_list_of_words() -> None:
    for bad in ([], ["ls", 3]):
        with pytest.raises(ConfigError, match="a list of strings, the program first"):
            watchdog.at_end(bad)  # type: ignore[list-item]
