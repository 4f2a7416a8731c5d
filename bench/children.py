"""The child processes of ``bench/transfer.py``: each runs that script with a hidden option, prints ``PROGRESS``
lines and one ``RESULT`` line (JSON), and is stopped on a timeout."""

import contextlib
import json
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from rich.console import Console

SCRIPT = str(Path(__file__).resolve().with_name("transfer.py"))  #: what every child runs (its hidden options)
WORKER_TIMEOUT_S = 240


def progress(message: str) -> None:
    """In a child: a line the parent echoes."""
    print("PROGRESS", message, flush=True)


def run_child(cmd: list[str], env: dict[str, str], label: str, console: Console) -> dict[str, Any]:
    """Run a child (``cmd``, usually :data:`SCRIPT` with a hidden option), echo its ``PROGRESS`` lines and return its ``RESULT``; stop it after
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
