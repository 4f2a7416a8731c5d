"""The options several commands share, and the one place their defaults come from: the config classes.

A default is read from the config field (or the function parameter) it ends up in, never retyped, so a
change of ``PoolConfig.namespace`` or ``RemoteConfig.flush_after_s`` changes ``--help`` and the behaviour of
every command with it.  The builders turn the options' values into those config objects.
"""

import inspect
import os
from collections.abc import Callable
from typing import Annotated, Any

import typer
from msgspec import Meta

from kvpool.core.config import default_of as field_default
from kvpool.core.config import validated
from kvpool.errors import ConfigError
from kvpool.metadata.config import ENDPOINTS_ENV, TLS_ENV, MetadataConfig
from kvpool.pool.config import PoolConfig
from kvpool.pool.tiers.s3_config import RemoteConfig
from kvpool.prefill_decode.routing.cost import REFERENCE_HARDWARE, Hardware
from kvpool.prefill_decode.vllm.config import ConnectorConfig


def parameter_default(func: Callable[..., Any], name: str) -> Any:
    """The default of parameter ``name`` of ``func``."""
    default = inspect.signature(func).parameters[name].default
    if default is inspect.Parameter.empty:
        raise LookupError(f"{func.__qualname__} has no default for {name!r}")
    return default


#: the --help panels that group the options of commands with many (``up``, ``join``), in the order a user sets
#: a pool up; an option in no panel shows under "Options"
ETCD_PANEL, RAY_PANEL, SEGMENTS_PANEL, REMOTE_PANEL = (
    "Metadata (etcd)",
    "Ray cluster",
    "Segments (per node)",
    "Remote tier (S3)",
)


ETCD = typer.Option(
    None,
    "--etcd",
    envvar=ENDPOINTS_ENV,
    help="etcd endpoints of the pool, host:port[,host:port...]. Without it, up and bench start an embedded etcd.",
    rich_help_panel=ETCD_PANEL,
)
#: the directory of a cluster's etcd certificates, for every command that reaches etcd
TLS_DIR_ENV = "KVPOOL_ETCD_TLS"
ETCD_TLS = typer.Option(
    None,
    "--etcd-tls",
    envvar=TLS_DIR_ENV,
    help="Reach etcd over TLS only, with the CA and client certificate in this directory (ca.pem, client.pem, "
    "client-key.pem, as 'kvpool etcd --tls-dir' or 'kvpool certs' make them). Without --etcd, up starts its embedded "
    f"etcd with TLS from it. Or set {', '.join(TLS_ENV.values())}.",
    show_default=False,
    rich_help_panel=ETCD_PANEL,
)
CLUSTER = typer.Option(
    field_default(MetadataConfig, "cluster"),
    "--cluster",
    help="Cluster name: namespaces every key, so pools can share one etcd.",
    rich_help_panel=ETCD_PANEL,
)
RAY_ADDRESS = typer.Option(
    ..., "--ray-address", help="The Ray cluster the pool runs on (head host:port).", rich_help_panel=RAY_PANEL
)
NAMESPACE = typer.Option(
    field_default(PoolConfig, "namespace"),
    "--namespace",
    help="The Ray namespace of the pool's PoolNode actors.",
    rich_help_panel=RAY_PANEL,
)
NVME_DIR = typer.Option(
    field_default(PoolConfig, "nvme_dir"),
    "--nvme-dir",
    help="Where NVMe segment files go. Default: a temp dir per node.",
    show_default=False,
    rich_help_panel=SEGMENTS_PANEL,
)
NVME_CODEC = typer.Option(
    field_default(PoolConfig, "nvme_codec"),
    "--nvme-codec",
    help="How chunks put as tensors are stored on NVMe: raw, fp8-e4m3, int4+zstd, ...",
    rich_help_panel=SEGMENTS_PANEL,
)
S3_BUCKET = typer.Option(
    field_default(RemoteConfig, "bucket"),
    "--s3-bucket",
    envvar="KVPOOL_S3_BUCKET",
    help="Bucket of the remote tier; empty: no remote tier.  Keys: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.",
    show_default=False,
    rich_help_panel=REMOTE_PANEL,
)
S3_ENDPOINT = typer.Option(
    field_default(RemoteConfig, "endpoint_url"),
    "--s3-endpoint",
    help="S3 endpoint URL (e.g. http://127.0.0.1:8333). Default: AWS_ENDPOINT_URL, else AWS.",
    show_default=False,
    rich_help_panel=REMOTE_PANEL,
)
S3_CODEC = typer.Option(
    field_default(RemoteConfig, "codec"),
    "--s3-codec",
    help="How chunks are stored in the remote tier, e.g. int4+zstd.",
    rich_help_panel=REMOTE_PANEL,
)
FLUSH_AFTER = typer.Option(
    field_default(RemoteConfig, "flush_after_s"),
    "--flush-after",
    min=0.1,
    help="Seconds an NVMe chunk stays unread before it is copied to the remote tier.",
    rich_help_panel=REMOTE_PANEL,
)
REPLICAS = typer.Option(
    field_default(ConnectorConfig, "replicas"), "--replicas", min=1, help="Copies of each chunk, on distinct nodes."
)


def metadata_config(etcd: str | None, cluster: str, tls_dir: str | None = None) -> MetadataConfig:
    """``--etcd``, ``--cluster`` and ``--etcd-tls`` (else ``$KVPOOL_ETCD_TLS``, else the ``KVPOOL_ETCD_CA`` /
    ``_CERT`` / ``_KEY`` files) as a config; no endpoints means "start an embedded etcd"."""
    endpoints = tuple(e.strip() for e in (etcd or "").split(",") if e.strip())
    tls_dir = tls_dir or os.environ.get(TLS_DIR_ENV, "").strip()
    if not tls_dir:
        return MetadataConfig.from_env(endpoints=endpoints, cluster=cluster)
    from kvpool.servers.certs import SERVER_NAME, client_files

    files = client_files(tls_dir)
    return MetadataConfig(
        endpoints=endpoints,
        cluster=cluster,
        tls_ca=str(files.ca),
        tls_cert=str(files.cert),
        tls_key=str(files.key),
        tls_server_name=SERVER_NAME,
    )


def pool_etcd(etcd: str | None, cluster: str, command: str, tls_dir: str | None = None) -> MetadataConfig:
    """The metadata config of a running pool, which ``command`` needs: its etcd must be given."""
    config = metadata_config(etcd, cluster, tls_dir)
    if not config.endpoints:
        raise ConfigError(f"{command} needs the pool's etcd: pass --etcd host:port or set {ENDPOINTS_ENV}")
    return config


def remote_config(bucket: str, endpoint: str, codec: str, flush_after_s: float) -> RemoteConfig:
    """The ``--s3-*`` and ``--flush-after`` options as a config (off without a bucket)."""
    return RemoteConfig(bucket=bucket, endpoint_url=endpoint, codec=codec, flush_after_s=flush_after_s)


#: ``--tflops`` of the commands that price reloads against prefill (plan, advise)
TFLOPS_HELP = f"Effective prefill compute, TFLOP/s. Default: {REFERENCE_HARDWARE.flops / 1e12:g} (reference analysis)."


def gbps_option(tier: str, label: str) -> Any:
    default = REFERENCE_HARDWARE.bandwidth[tier] / 1e9
    return typer.Option(
        None,
        f"--{tier}-gbps",
        help=f"{label} tier read bandwidth, GB/s (decimal). Default: {default:g} (reference analysis).",
    )


_Figure = Annotated[float, Meta(gt=0, description="a number > 0")]


def overridden(hardware: Hardware, tflops: float | None, gbps: dict[str, float | None]) -> Hardware:
    """``hardware`` with the figures given on the command line (each > 0)."""
    flags = {"--tflops": tflops, **{f"--{tier}-gbps": value for tier, value in gbps.items()}}
    for flag, value in flags.items():
        if value is not None:
            validated(_Figure, value, flag)
    bandwidth = {tier: None if value is None else value * 1e9 for tier, value in gbps.items()}
    return hardware.with_overrides(flops=None if tflops is None else tflops * 1e12, **bandwidth)
