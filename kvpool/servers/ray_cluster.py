"""A Ray cluster of several nodes on this one machine: the embedded default, the demo and the tests.

Node ``i`` runs ``ray start --block`` on loopback address ``127.0.0.<2+i>`` (Ray rewrites 127.0.0.1, so
it is never used) with its own free ports.  Stopping terminates exactly those processes, which then
shut their Ray processes down: never ``ray stop``, which would kill every Ray on the machine.
"""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import ray

from kvpool.errors import KvPoolError
from kvpool.servers.etcd import free_port

log = logging.getLogger(__name__)
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


class LocalRayCluster:
    def __init__(self, nodes: int = 1, *, first_ip: int = 2, num_cpus: int = 1, object_store_mib: int = 96) -> None:
        if not 1 <= nodes <= 32:
            raise ValueError(f"nodes must be in [1, 32], got {nodes}")
        self.ips = [f"127.0.0.{first_ip + i}" for i in range(nodes)]
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_mib * 2**20
        self.port = free_port(self.ips[0])
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def address(self) -> str:
        return f"{self.ips[0]}:{self.port}"

    def _ray_start(self, ip: str, head: bool) -> subprocess.Popen[bytes]:
        ray_bin = str(Path(sys.executable).with_name("ray"))
        where = (
            ["--head", f"--port={self.port}", "--include-dashboard=false"] if head else [f"--address={self.address}"]
        )
        args = [
            ray_bin, "start", *where, f"--node-ip-address={ip}", f"--num-cpus={self.num_cpus}",
            f"--object-store-memory={self.object_store_bytes}", f"--dashboard-agent-listen-port={free_port(ip)}",
            "--disable-usage-stats", "--block",
        ]  # fmt: skip
        return subprocess.Popen(
            args,
            env={**os.environ, **RAY_ENV},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def start(self, timeout_s: float = 180.0) -> "LocalRayCluster":
        """Start every node and connect this process to the cluster as its driver."""
        os.environ.update(RAY_ENV)
        deadline = time.monotonic() + timeout_s
        self._procs.append(self._ray_start(self.ips[0], head=True))
        try:
            self._connect(deadline)
            for i, ip in enumerate(self.ips[1:], start=2):  # one at a time: 2 cores cannot start several at once
                self._procs.append(self._ray_start(ip, head=False))
                while sum(n["Alive"] for n in ray.nodes()) < i:
                    self._check_alive()
                    if time.monotonic() > deadline:
                        raise KvPoolError(f"local Ray cluster: {len(self.ips)} nodes not up within {timeout_s:.0f} s")
                    time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        log.info("local Ray cluster up: %s", ", ".join(self.ips))
        return self

    def _connect(self, deadline: float) -> None:
        while True:
            self._check_alive()
            try:
                ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
                return
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def _check_alive(self) -> None:
        for p in self._procs:
            if p.poll() is not None:
                err = p.stderr.read().decode(errors="replace")[-2000:] if p.stderr else ""
                raise KvPoolError(f"'ray start' exited with {p.returncode}: {err.strip() or 'no output'}")

    def node_ids(self) -> list[str]:
        """Ray node ids, in the order of ``self.ips`` (the head first)."""
        by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return [by_ip[ip] for ip in self.ips]

    def stop(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self._procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs.clear()

    def __enter__(self) -> "LocalRayCluster":
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
