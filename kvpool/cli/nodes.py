"""The pool's nodes on a Ray cluster that is already up: ``kvpool join`` starts this node's ``PoolNode``
(what every node of a ``ray up`` cluster runs), ``kvpool down`` stops them all."""

import os
from typing import Any

import typer
from msgspec.structs import replace

from kvpool.cli import options, root
from kvpool.cli.figures import size
from kvpool.errors import ConfigError, SetupError
from kvpool.pool.config import MiB, PoolConfig


@root.app.command()
def down(ray_address: str = options.RAY_ADDRESS, namespace: str = options.NAMESPACE) -> None:
    """Stop every PoolNode of a pool started with 'kvpool up --hold --ray-address', 'kvpool join' or start_pool().

    Each node revokes its lease first, so its records and placements leave etcd at once; segments are
    freed.  Ray and etcd themselves keep running.
    """
    import ray

    from kvpool.pool.node import stop_pool
    from kvpool.ray_auth import attach

    with root.errors():
        attach(ray_address)
        try:
            with root.console.status("stopping PoolNode actors"):
                stopped = stop_pool(PoolConfig(namespace=namespace))
        finally:
            ray.shutdown()
        root.console.print(f"stopped {stopped} pool node(s) in namespace {namespace!r}")


def _ray_node(node_ip: str) -> dict[str, Any]:
    """The alive Ray node at ``node_ip`` (default: this machine's address as Ray sees it)."""
    import ray

    ip = node_ip or ray.util.get_node_ip_address()
    alive = [n for n in ray.nodes() if n["Alive"]]
    node = next((n for n in alive if n["NodeManagerAddress"] == ip), None)
    if node is None:
        addresses = ", ".join(sorted(n["NodeManagerAddress"] for n in alive))
        raise ConfigError(f"no alive Ray node at {ip} (alive: {addresses}); pass --node-ip")
    return node


def _start_node(ray_address: str, node_ip: str, base: PoolConfig, dram_mib: int, nvme_mib: int) -> tuple[Any, str]:
    """Start the PoolNode of the Ray node at ``node_ip``, sized by the MiB given or else by the node's Ray
    resources; returns its ``NodeInfo`` and the node's address."""
    import ray

    from kvpool.pool.node import start_pool
    from kvpool.ray_auth import attach

    attach(ray_address)
    try:
        node = _ray_node(node_ip)
        res = node["Resources"]
        pool = replace(
            base,
            dram_bytes=int(dram_mib or res.get("kvpool_dram_mib", 0)) * MiB,
            nvme_bytes=int(nvme_mib or res.get("kvpool_nvme_mib", 0)) * MiB,
        )
        ip = node["NodeManagerAddress"]
        with root.console.status(f"starting the PoolNode on {ip}"):
            try:
                info = ray.get(start_pool(pool, [node["NodeID"]])[node["NodeID"]].info.remote())
            except ray.exceptions.RayActorError as exc:  # its constructor raised: the traceback's last line says why
                why = str(exc).strip().splitlines()[-1]
                raise ConfigError(f"the PoolNode on {ip} did not start: {why}") from None
        return info, ip
    finally:
        ray.shutdown()


NODE_IP = typer.Option(
    "",
    "--node-ip",
    envvar="KVPOOL_NODE_IP",
    help="This node's Ray address. Default: the one Ray detects.",
    show_default=False,
    rich_help_panel=options.RAY_PANEL,
)
DRAM_MIB = typer.Option(
    0,
    "--dram-mib",
    min=0,
    help="DRAM segment, MiB. 0: the node's Ray resource kvpool_dram_mib, else the pool's default.",
    rich_help_panel=options.SEGMENTS_PANEL,
)
NVME_MIB = typer.Option(
    0,
    "--nvme-mib",
    min=0,
    help="NVMe segment, MiB. 0: the node's Ray resource kvpool_nvme_mib, else the pool's default.",
    rich_help_panel=options.SEGMENTS_PANEL,
)
NVME_DIR = typer.Option(
    "~/.kvpool/nvme",
    "--nvme-dir",
    help="Where this node's NVMe segment lives (created if missing). It outlives the node: started again here, "
    "the node takes back every chunk of it that still verifies (warm restart). '' for a temp dir per start.",
    rich_help_panel=options.SEGMENTS_PANEL,
)
METRICS_HOST = typer.Option(
    options.field_default(PoolConfig, "metrics_host"), "--metrics-host", help="Where the node serves its metrics."
)
METRICS_PORT = typer.Option(
    options.field_default(PoolConfig, "metrics_port"),
    "--metrics-port",
    min=-1,
    max=65535,
    help="The port of the node's metrics: 0 a free one (published in its node record), -1 none; a fixed one for "
    "probes and scrapers that cannot read etcd (Kubernetes).",
)


@root.app.command()
def join(
    ray_address: str = options.RAY_ADDRESS,
    etcd: str | None = options.ETCD,
    etcd_tls: str | None = options.ETCD_TLS,
    cluster: str = options.CLUSTER,
    namespace: str = options.NAMESPACE,
    node_ip: str = NODE_IP,
    dram_mib: int = DRAM_MIB,
    nvme_mib: int = NVME_MIB,
    nvme_dir: str = NVME_DIR,
    metrics_host: str = METRICS_HOST,
    metrics_port: int = METRICS_PORT,
    nvme_codec: str = options.NVME_CODEC,
    s3_bucket: str = options.S3_BUCKET,
    s3_endpoint: str = options.S3_ENDPOINT,
    s3_codec: str = options.S3_CODEC,
    flush_after: float = options.FLUSH_AFTER,
) -> None:
    """Start this node's PoolNode actor (detached) and return: what each node of a 'ray up' cluster runs.

    The node is the Ray node at --node-ip; its capacity comes from --dram-mib / --nvme-mib or, when those
    are not given, from the Ray resources kvpool_dram_mib / kvpool_nvme_mib it was started with (and the
    pool's defaults when it has neither).  Running it twice is harmless.  'kvpool down' stops the pool.
    """
    with root.errors():
        if nvme_dir:
            nvme_dir = os.path.expanduser(nvme_dir)
            try:
                os.makedirs(nvme_dir, exist_ok=True)
            except OSError as exc:
                raise SetupError(f"--nvme-dir {nvme_dir} cannot be created ({exc.strerror}): give another") from None
        base = PoolConfig(
            metadata=options.pool_etcd(etcd, cluster, "join", etcd_tls),
            nvme_dir=nvme_dir,
            namespace=namespace,
            metrics_host=metrics_host,
            metrics_port=metrics_port,
            nvme_codec=nvme_codec,
            remote=options.remote_config(s3_bucket, s3_endpoint, s3_codec, flush_after),
        )
        info, ip = _start_node(ray_address, node_ip, base, dram_mib, nvme_mib)
        nvme = f"NVMe {size(info.nvme_capacity)}" + (" (O_DIRECT)" if info.nvme_direct else "")
        root.console.print(
            f"pool node {info.node_id[:12]} up on {ip}: DRAM {size(info.dram_capacity)}, {nvme}, "
            f"metrics {info.metrics_address or 'off'}"
        )
        if info.restart:
            root.console.print(f"warm restart from {info.nvme_path}: {info.restart}")
