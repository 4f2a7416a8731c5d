"""A watchdog that stops what this process started once this process is gone, however it goes.

kvpool starts servers in sessions of their own (:class:`~kvpool.servers.process.ServerProcess`: etcd, SeaweedFS, each
Ray node and every process that node starts) and stops them on exit.  A process killed with SIGKILL (an OOM kill, a
CI timeout, ``kill -9`` of ``kvpool up --hold``) runs no exit code: its servers would live on, holding ports, CPU and
the pool's segments in ``/dev/shm``.  So the first server a process starts also starts this watchdog, a small
process in a session of its own that the starter tells, over a pipe, which sessions to guard (and which to let go of
once stopped) and which commands to run at the end.  The watchdog waits on the starter's pidfd (and on the pipe's
end): when the starter is gone it sends SIGTERM to every process of every guarded session, SIGKILL to what is left
after ``GRACE_S``, runs the end commands (e.g. reaping the dead pool nodes' segment files), and exits.

``python -m kvpool.servers.watchdog`` is that process; :func:`guard` and :func:`at_end` are the starter's side.
"""

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Annotated

from msgspec import Meta

from kvpool.core.config import validated
from kvpool.core.procs import proc_stat

log = logging.getLogger(__name__)
_Argv = Annotated[list[str], Meta(min_length=1, description="a list of strings, the program first")]

GRACE_S = 10.0  #: between SIGTERM and SIGKILL of what a dead starter left
KILLED_S = 5.0  #: how long SIGKILLed processes are given to be gone
END_COMMAND_S = 60.0  #: how long an end command may run


class _Link:
    """The starter's side: the watchdog process and the pipe to it (made on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._pid = 0  #: the process that started it (a forked child starts its own)

    def send(self, line: str) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._proc, self._pid = self._start(), os.getpid()
            if self._proc is None or self._proc.stdin is None:
                return
            try:
                self._proc.stdin.write(line + "\n")
                self._proc.stdin.flush()
            except OSError as exc:  # it died: what this process starts from now on is not guarded
                log.warning("kvpool's watchdog is gone (%s): servers started now may outlive a killed kvpool", exc)
                self._proc = None

    @staticmethod
    def _start() -> "subprocess.Popen[str] | None":
        try:
            return subprocess.Popen(
                [sys.executable, "-m", __name__, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in the starter's terminal is the starter's to handle
                text=True,
            )
        except OSError as exc:
            log.warning("cannot start kvpool's watchdog (%s): servers may outlive a killed kvpool", exc)
            return None


_link = _Link()


def guard(session: int) -> None:
    """Stop every process of ``session`` (a server started with ``start_new_session``: its pid) if this process
    dies before :func:`release`."""
    _link.send(json.dumps({"guard": session, "since": _started(session)}))


def release(session: int) -> None:
    """``session`` is stopped: the watchdog forgets it (its id may be reused)."""
    _link.send(json.dumps({"release": session}))


def remove_at_end(path: "str | os.PathLike[str]") -> None:
    """Remove the folder ``path`` (a server's temp folder: its data, logs, token) once this process is gone, after its
    sessions are stopped; one removed on a normal stop is simply not there then."""
    _link.send(json.dumps({"remove": os.fspath(path)}))


def at_end(argv: Sequence[str]) -> None:
    """Run ``argv`` once this process is gone, after its sessions are stopped (each at most ``END_COMMAND_S``)."""
    _link.send(json.dumps({"at_end": validated(_Argv, list(argv), "an end command")}))


# -- the watchdog process --------------------------------------------------------------------------------------------


def _started(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (0: no such pid): with the pid, which process it is."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields is not None else 0


def session_members(sessions: set[int]) -> list[int]:
    """The pids of live processes in ``sessions``."""
    found = []
    for entry in os.scandir("/proc"):
        fields = proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None and int(fields[3]) in sessions and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def stop_sessions(sessions: set[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every process of ``sessions``, SIGKILL to those still there after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILLED_S)):
        for pid in session_members(sessions):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while session_members(sessions) and time.monotonic() < deadline:
            time.sleep(0.1)


def watch(starter: int, commands: int, grace_s: float = GRACE_S) -> None:
    """Follow the commands read from fd ``commands`` until ``starter`` is gone (its pidfd, else its being our parent
    no more, or the pipe's end), then stop its sessions and run its end commands."""
    sessions: dict[int, int] = {}  #: session -> when its leader started
    ends: list[list[str]] = []
    gone = _pidfd(starter)
    pending = b""

    def read() -> bool:
        """Obey what can be read now; False at the pipe's end (every writer, the starter's forks too, is gone)."""
        nonlocal pending
        chunk = os.read(commands, 65536)
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            _obey(line, sessions, ends)
        return bool(chunk)

    while True:
        waits = [commands] if gone is None else [commands, gone]
        ready = select.select(waits, [], [], None if gone is not None else 0.5)[0]
        if commands in ready and not read():
            break
        if (gone in ready) if gone is not None else os.getppid() != starter:
            while select.select([commands], [], [], 0)[0] and read():  # what it said before it went
                pass
            break
    # a session whose leader's pid now names another process is not ours any more (it ended and the pid was reused)
    stop_sessions({sid for sid, since in sessions.items() if _started(sid) in (0, since)}, grace_s)
    for argv in ends:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(argv, timeout=END_COMMAND_S, stdin=subprocess.DEVNULL, capture_output=True)


def _obey(line: bytes, sessions: dict[int, int], ends: list[list[str]]) -> None:
    """One command of the starter's (a JSON object: ``guard`` with ``since``, ``release``, or ``at_end``)."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        said = json.loads(line)
        if "guard" in said:
            sessions[int(said["guard"])] = int(said["since"])
        elif "release" in said:
            sessions.pop(int(said["release"]), None)
        elif "at_end" in said:
            ends.append([str(word) for word in said["at_end"]])
        elif "remove" in said:
            ends.append(["rm", "-rf", "--", str(said["remove"])])


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``, readable once it exits (None where the kernel has none: then the parent is polled)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def main(argv: Iterable[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the starter's Ctrl-C is the starter's
    watch(int(args[0]), sys.stdin.fileno())


if __name__ == "__main__":
    main()
