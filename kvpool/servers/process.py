"""One server child process, the way every launcher here runs its server (etcd, SeaweedFS, Ray nodes).

A :class:`ServerProcess` starts its command in a session of its own with the output going to a log file,
waits until a readiness check passes (or the process exits, or a deadline passes: then the log's tail is in
the error), and stops it with SIGTERM, then SIGKILL to its whole session after a grace period.  Stopping
also runs at garbage collection and interpreter exit, so a server never outlives the process that started
it; where that process is killed and runs no exit code, :mod:`~kvpool.servers.watchdog` stops the server's whole
session.  Ports come from :func:`kvpool.core.net.free_ports`.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NoReturn

from kvpool.errors import KvPoolError, SetupError
from kvpool.servers import watchdog

#: a readiness check: None once the server serves, else what is still missing (it goes into the timeout error)
Ready = Callable[[], str | None]


def server_binary(name: str, env: str, candidates: Iterable[str | Path], install: str) -> str:
    """A server's binary: ``$env`` when set (it must be executable), else the first executable of ``candidates``;
    ``SetupError`` saying how to get one (``install``) otherwise."""
    explicit = os.environ.get(env)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise SetupError(f"{env}={explicit!r} is not an executable file")
        return explicit
    for path in candidates:
        if os.access(path, os.X_OK):
            return str(path)
    raise SetupError(f"no executable {name} binary: {install}, or set {env}")


def log_tail(path: Path, lines: int = 8) -> str:
    """The last ``lines`` lines of the log at ``path`` ("" when there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


class ServerProcess:
    """``args`` run as a server: :meth:`start` until ``ready``, :meth:`stop` within ``grace_s`` then killed.

    ``cleanup`` runs once, on :meth:`stop` (or collection, or exit), after the process is gone: it removes what
    the server left behind (its temporary directory, sockets).  :meth:`kill` then :meth:`start` again restarts
    the same command on the same files, which is how the tests crash and restart a server.
    """

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        grace_s: float = 5.0,
        cleanup: Callable[[], None] | None = None,
    ) -> None:
        self.name, self.args, self.log_path, self.env, self.grace_s = name, list(args), log_path, env, grace_s
        self._cleanup = cleanup
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer = weakref.finalize(self, _stop, None, grace_s, cleanup)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, ready: Ready, timeout_s: float, error: type[KvPoolError], *, poll_s: float = 0.05) -> None:
        """Run the command and wait until ``ready()`` returns None; ``error`` (with the log's tail) if the
        process exits first or ``timeout_s`` passes, after stopping it."""
        if self.running():
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logfile:  # the child keeps its own descriptor
            self._proc = subprocess.Popen(
                self.args, stdout=logfile, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        watchdog.guard(self._proc.pid)  # its session dies with this process, however this process dies
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self._proc, self.grace_s, self._cleanup)
        deadline, missing = time.monotonic() + timeout_s, "no answer yet"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._fail(error, f"{self.name} exited during start-up (code {self._proc.returncode})")
            why = ready()
            if why is None:
                return
            missing = why
            time.sleep(poll_s)
        self._fail(error, f"{self.name} did not start within {timeout_s:.0f} s ({missing})")

    def _fail(self, error: type[KvPoolError], what: str) -> NoReturn:
        """Stop, keeping a copy of the log (``cleanup`` may remove the original), and raise ``error``."""
        word = self.name.split()[0].strip("'").lower()  # "'ray start' on ..." -> ray
        kept = Path(tempfile.mkstemp(prefix=f"kvpool-{word}-", suffix=".log")[1])
        with contextlib.suppress(OSError):
            shutil.copyfile(self.log_path, kept)
        self.stop()
        raise error(f"{what}; see {kept}, which ends:\n{log_tail(kept) or '(empty)'}")

    def terminate(self) -> None:
        """SIGTERM, without waiting: :meth:`stop` waits (to stop several servers at once)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL its session, keeping every file: a crash, for tests."""
        if self._proc is not None and self._proc.poll() is None:
            _kill(self._proc)

    def stop(self) -> None:
        """SIGTERM, SIGKILL to its session after ``grace_s``, then ``cleanup``; idempotent."""
        self._finalizer()


def _kill(proc: "subprocess.Popen[bytes]") -> None:
    """SIGKILL a live server's whole session (what it started too); only while it is unreaped, so that its
    process-group id cannot have been reused."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _stop(proc: "subprocess.Popen[bytes] | None", grace_s: float, cleanup: Callable[[], None] | None) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
    if proc is not None:
        watchdog.release(proc.pid)
    if cleanup is not None:
        cleanup()
