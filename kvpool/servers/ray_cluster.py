"""A Ray cluster of several nodes on this one machine: the embedded default, the demo and the tests.

Node ``i`` runs ``ray start --block`` on loopback address ``127.0.0.<2+i>`` (Ray rewrites 127.0.0.1, so
it is never used).  Every port is left to Ray to bind (``--port=0``): a port picked here and handed over would be
free only until some other Ray on the machine binds it first, and then the head's GCS fails to start.  The head's
address is read from what ``ray start`` prints.  Token authentication is on unless asked off (``auth="disabled"``, or
the user's own ``RAY_AUTH_MODE=disabled``): a token is generated per cluster into a file only its owner can read
(``token_path``), every node and this driver use it, and so does every process started from here while the cluster
runs (they inherit ``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN_PATH``).  Stopping terminates exactly those processes, which then
shut their Ray processes down: never ``ray stop``, which would kill every Ray on the machine.

No node runs Ray's log monitor, which streams workers' output to drivers: kvpool's drivers attach without it
(``log_to_driver=False``), and each monitor cost ~1 % of a core idle.  Workers' output stays in the session's log
files (``/tmp/ray/session_*/logs``).
"""

import functools
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Annotated

import ray
from msgspec import Meta

from kvpool import ray_auth
from kvpool.core.config import Positive, checked
from kvpool.errors import KvPoolError
from kvpool.servers import watchdog
from kvpool.servers.process import ServerProcess

log = logging.getLogger(__name__)
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


#: what ``ray start --head`` prints once its GCS serves: the line the other nodes join with
_JOIN_LINE = re.compile(r"ray start --address='(\S+)'")

_Nodes = Annotated[int, Meta(ge=1, le=32, description="from 1 to 32 nodes")]


class LocalRayCluster:
    @checked
    def __init__(
        self,
        nodes: _Nodes = 1,
        *,
        first_ip: int = 2,
        num_cpus: Positive = 1,
        object_store_mib: Positive = 96,
        auth: str | None = None,
    ) -> None:
        self.ips = [f"127.0.0.{first_ip + i}" for i in range(nodes)]
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_mib * 2**20
        self.port: int | None = None  #: the head's GCS port, bound by Ray on start
        self._nodes: list[ServerProcess] = []
        self.auth = ray_auth.requested_mode(auth)  #: token or disabled
        self._log_dir: Path | None = None  #: the 'ray start' logs (and the token), made on start, removed on stop
        self._saved_env: dict[str, str | None] = {}  #: this process's authentication variables before start

    @property
    def token_path(self) -> Path | None:
        """The file holding the cluster's token while it runs (None: authentication disabled, or not started)."""
        return self._log_dir / ray_auth.TOKEN_FILE if self._log_dir is not None and self.auth == "token" else None

    @property
    def address(self) -> str:
        assert self.port is not None, "the cluster's address is known once start() has read it"
        return f"{self.ips[0]}:{self.port}"

    def _ray_start(self, ip: str, head: bool) -> ServerProcess:
        ray_bin = str(Path(sys.executable).with_name("ray"))
        where = ["--head", "--port=0", "--include-dashboard=false"] if head else [f"--address={self.address}"]
        args = [
            ray_bin,
            "start",
            *where,
            f"--node-ip-address={ip}",
            f"--num-cpus={self.num_cpus}",
            f"--object-store-memory={self.object_store_bytes}",
            "--dashboard-agent-listen-port=0",
            "--include-log-monitor=false",  # see the module's docstring
            "--disable-usage-stats",
            "--block",
        ]
        assert self._log_dir is not None
        env = {**os.environ, **RAY_ENV}  # this process runs in the cluster's mode already (start)
        node = ServerProcess(f"'ray start' on {ip}", args, self._log_dir / f"ray-{ip}.log", env=env, grace_s=60.0)
        self._nodes.append(node)
        return node

    def start(self, timeout_s: float = 180.0) -> "LocalRayCluster":
        """Start every node and connect this process to the cluster as its driver."""
        os.environ.update(RAY_ENV)
        deadline = time.monotonic() + timeout_s
        self._saved_env = ray_auth.saved_env()
        self._log_dir = Path(tempfile.mkdtemp(prefix="kvpool-ray-"))  # 0700: only its owner reads the token
        watchdog.remove_at_end(self._log_dir)
        try:
            if self.token_path is not None:
                ray_auth.write_token(self.token_path)
            ray_auth.use(self.auth, self.token_path)
            head = self._ray_start(self.ips[0], head=True)
            head.start(functools.partial(self._connected, head.log_path), timeout_s, KvPoolError, poll_s=0.3)
            for i, ip in enumerate(self.ips[1:], start=2):  # one at a time: 2 cores cannot start several at once
                alive = functools.partial(self._alive, i)
                self._ray_start(ip, head=False).start(alive, deadline - time.monotonic(), KvPoolError, poll_s=0.2)
        except BaseException:
            self.stop()
            raise
        log.info("local Ray cluster up: %s (authentication: %s)", ", ".join(self.ips), self.auth)
        return self

    def _connected(self, head_log: Path) -> str | None:
        """None once this process is the cluster's driver, else why not.  Nothing is tried before the head has
        printed its address: ``ray.init`` waits minutes for a GCS that is not there, while the head may have
        exited (and the start loop would only see it then)."""
        if self.port is None:
            printed = _JOIN_LINE.search(head_log.read_text(errors="replace")) if head_log.exists() else None
            if printed is None:
                return "the head has not printed its address yet"
            self.port = int(printed.group(1).rpartition(":")[2])
        try:
            ray_auth.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
            return None
        except ConnectionError as exc:
            return str(exc)

    def _alive(self, n: int) -> str | None:
        """None once ``n`` nodes are alive, else how many are."""
        alive = sum(node["Alive"] for node in ray.nodes())
        return None if alive >= n else f"{alive} of {n} nodes alive"

    def node_ids(self) -> list[str]:
        """Ray node ids, in the order of ``self.ips`` (the head first)."""
        by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return [by_ip[ip] for ip in self.ips]

    def stop(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(self._nodes):
            node.terminate()  # all at once, then each waited on
        for node in self._nodes:
            node.stop()
        self._nodes.clear()
        self.port = None
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None
            ray_auth.restore(self._saved_env)

    def __enter__(self) -> "LocalRayCluster":
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
