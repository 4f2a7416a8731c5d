"""Engines forked from a process that imported vLLM once: a tiny model's engine starts in ~2 s instead of ~8 here.

Importing vLLM takes ~8 CPU-seconds (torch, transformers, its configs and kernels), more than building a small
model's engine.  :class:`Zygote` starts ``python -m kvpool.prefill_decode.vllm.zygote SOCKET``, which imports vLLM and
kvpool's connector, then forks a child per request: the child takes the requester's stdin, stdout and stderr (passed
over a Unix socket), its environment and its settings, and runs :func:`~kvpool.prefill_decode.vllm.engine.serve` as
``python -m kvpool.prefill_decode.vllm.engine`` would.  :class:`~kvpool.prefill_decode.vllm.engine.EngineProcess`
uses one when given (the engine tests share one).

What a fork cannot change is what the interpreter and its libraries read when they start (``PYTHONHASHSEED``,
``OMP_*``, ``LD_*``, vLLM's logging set-up): an engine asked with other values of those is started the usual way
(:meth:`Zygote.serves`).  Forking is safe here because nothing has run a torch kernel in the zygote (no OpenMP pool
to lose); its only threads wait for its children's exit codes.
"""

import contextlib
import json
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

from kvpool.errors import WorkerUnavailable

#: variables read when a process starts (the interpreter, OpenMP, the loader, vLLM's logging): a fork keeps the
#: zygote's.  Not PYTHONBREAKPOINT, which breakpoint() reads when called (and ray.init sets in its driver).
AT_START = re.compile(r"^(PYTHON(?!BREAKPOINT$)|OMP_|KMP_|MKL_|LD_|VLLM_LOGGING|VLLM_CONFIGURE_LOGGING)")


class ForkedProcess:
    """An engine forked by a zygote, with :class:`subprocess.Popen`'s ``stdin``, ``stdout``, ``poll``, ``wait`` and
    ``kill``; its exit code comes from the zygote, whose child it is."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str], exits: socket.socket) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self._exits = exits
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(timeout=0) if self.returncode is None and self._readable(0) else self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._readable(timeout):
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout or 0)
            answer = self._exits.recv(64)
            self.returncode = int(answer) if answer else -1  # the zygote itself gone: the code is lost
            self._exits.close()
        return self.returncode

    def _readable(self, timeout: float | None) -> bool:
        return bool(select.select([self._exits], [], [], timeout)[0])

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)


class Zygote:
    """A process that imported vLLM, forking engines on request; ``env``: its environment over this process's."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        from kvpool.prefill_decode.vllm.engine import ENGINE_ENV

        self.env = {**os.environ, **ENGINE_ENV, **(env or {})}
        self._dir = tempfile.TemporaryDirectory(prefix="kvpool-zygote-")
        self.path = str(Path(self._dir.name) / "socket")
        self.log = Path(self._dir.name) / "zygote.log"  #: its stderr (a pipe nobody reads could fill and stop it)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, self.path],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env,
            )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "READY":
            self.proc.wait()
            raise WorkerUnavailable(f"vLLM's zygote exited ({self.proc.returncode}): {self.log.read_text()[-4000:]}")

    def serves(self, env: dict[str, str]) -> bool:
        """Whether an engine with environment ``env`` can be forked from here (its start-time variables are ours)."""
        names = {k for k in (*env, *self.env) if AT_START.match(k)}
        return self.proc.poll() is None and all(env.get(k) == self.env.get(k) for k in names)

    def spawn(self, settings: dict[str, Any], env: dict[str, str], stderr: IO[str]) -> ForkedProcess:
        """An engine for ``settings`` (``engine.serve``'s), with environment ``env``, its stderr going to ``stderr``."""
        child_in, parent_out = os.pipe()
        parent_in, child_out = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            request = json.dumps({"settings": settings, "env": env}).encode()
            socket.send_fds(conn, [request], [child_in, child_out, stderr.fileno()])
            answer = conn.recv(64)
        finally:
            os.close(child_in)
            os.close(child_out)
        if not answer:
            conn.close()
            raise WorkerUnavailable(f"vLLM's zygote did not fork an engine; see {self.log}")
        return ForkedProcess(int(answer), os.fdopen(parent_out, "w"), os.fdopen(parent_in, "r"), conn)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # its stdin's end is its signal to go
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._dir.cleanup()

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _report(conn: socket.socket, pid: int) -> None:
    """Send the child's exit code to whoever asked for it, once it exits."""
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):  # the asker may be gone
        conn.send(str(os.waitstatus_to_exitcode(status)).encode())
    conn.close()


def _forks(path: str) -> dict[str, Any] | None:
    """Serve fork requests on ``path`` until stdin ends (None); in a forked child, its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    print("READY", flush=True)
    while True:
        ready, _, _ = select.select([listener, sys.stdin.fileno()], [], [])
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 4096):
            return None
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            for target, fd in enumerate(fds):  # stdin, stdout, stderr
                os.dup2(fd, target)
                os.close(fd)
            return dict(json.loads(message))
        for fd in fds:
            os.close(fd)
        conn.send(str(pid).encode())
        threading.Thread(target=_report, args=(conn, pid), daemon=True).start()


def main() -> None:
    import kvpool.prefill_decode.vllm.connector  # noqa: F401  (what an engine with the connector imports)
    from kvpool.prefill_decode.vllm import engine

    engine.preload()
    request = _forks(sys.argv[1])
    if request is None:
        return
    os.environ.clear()
    os.environ.update(request["env"])
    # the fds under these are the requester's now; they live as long as the process
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    engine.serve(request["settings"])


if __name__ == "__main__":
    main()
