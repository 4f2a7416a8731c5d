"""``kvpool vllm-config``: the ``--kv-transfer-config`` that points a vLLM engine at a running pool."""

import json

import typer

from kvpool.cli import connect, options, root
from kvpool.errors import ConfigError
from kvpool.prefill_decode.engine_config import ROLES, ConnectorConfig, kv_transfer_config


def _connector(name: str) -> object:
    return options.field_default(ConnectorConfig, name)


@root.app.command("vllm-config")
def vllm_config(
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    namespace: str = options.NAMESPACE,
    role: str = typer.Option(
        options.parameter_default(kv_transfer_config, "role"),
        "--role",
        help=f"{ROLES[0]} (save and load), {ROLES[1]} (a prefill engine) or {ROLES[2]} (a decode engine).",
    ),
    ray_address: str = typer.Option(
        _connector("ray_address"),
        "--ray-address",
        help="The pool's Ray cluster as the engine's host reaches it (auto: the local Ray).",
    ),
    model_id: str = typer.Option(
        _connector("model_id"),
        "--model-id",
        show_default=False,
        help="The model's name in chunk keys; engines of one model must agree. Default: vLLM's served name.",
    ),
    node_ip: str = typer.Option(
        _connector("node_ip"),
        "--node-ip",
        show_default=False,
        help="The engine host's Ray node IP, where one machine runs several (kvpool up: 127.0.0.2).",
    ),
    chunk_size: int = typer.Option(
        _connector("chunk_size"), "--chunk-size", min=1, help="Tokens per chunk: a multiple of vLLM's block size."
    ),
    replicas: int = options.REPLICAS,
) -> None:
    """Print vLLM's --kv-transfer-config for this pool: vllm serve MODEL --kv-transfer-config "$(kvpool vllm-config ...)"."""
    with root.errors():
        with connect.running_cache(etcd, cluster, "vllm-config") as cache:
            nodes = cache.nodes()
            endpoints = cache.etcd.config.endpoints
        if not nodes:
            raise ConfigError(
                f"no live pool nodes in cluster '{cluster}': start the pool first (kvpool up / kvpool join)"
            )
        config = ConnectorConfig(
            etcd=tuple(endpoints), cluster=cluster, namespace=namespace, ray_address=ray_address, node_ip=node_ip,
            model_id=model_id, chunk_size=chunk_size, replicas=replicas,
        )  # fmt: skip
        typer.echo(json.dumps(kv_transfer_config(config, role)))
        root.err_console.print(
            f"[dim]pool '{cluster}': {len(nodes)} live nodes; use it with: "
            f'vllm serve MODEL --kv-transfer-config "$(kvpool vllm-config --etcd {",".join(endpoints)} ...)"[/dim]',
            soft_wrap=True,
        )
