"""``kvpool sglang-config``: the flags that make a running pool an SGLang server's HiCache L3 tier."""

import json
import shlex
import sys

import typer

from kvpool.cli import connect, options, root
from kvpool.cli.vllm import NODE_IP, RAY_ADDRESS, RAY_TOKEN, token_file
from kvpool.prefill_decode.sglang.config import StorageConfig, extra_config, server_flags

MODEL_ID = typer.Option(
    options.field_default(StorageConfig, "model_id"),
    "--model-id",
    show_default=False,
    help="The model's name in page keys; servers of one model must agree. Default: SGLang's served model name.",
)

JSON = typer.Option(
    False,
    "--json",
    help='Print only the extra config (JSON), for --hicache-storage-backend-extra-config "$(kvpool sglang-config --json)".',
)


def launch_line(config: StorageConfig) -> str:
    """The command that starts SGLang's server on the pool ``config`` names, with this environment's interpreter (where
    ``kvpool`` is installed, as the ``dynamic`` backend loader needs); ``MODEL`` is the user's to fill in."""
    python = shlex.quote(sys.executable)
    return f"{python} -m sglang.launch_server --model-path MODEL {shlex.join(server_flags(config))}"


@root.app.command("sglang-config")
def sglang_config(
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    namespace: str = options.NAMESPACE,
    ray_address: str = RAY_ADDRESS,
    model_id: str = MODEL_ID,
    ray_token: str = RAY_TOKEN,
    node_ip: str = NODE_IP,
    replicas: int = options.REPLICAS,
    as_json: bool = JSON,
) -> None:
    """Print SGLang's HiCache flags for this pool: python -m sglang.launch_server --model-path M <these flags>."""
    with root.errors():
        nodes, endpoints = connect.live_pool(etcd, cluster, "sglang-config")
        config = StorageConfig(
            etcd=endpoints,
            cluster=cluster,
            namespace=namespace,
            ray_address=ray_address,
            ray_token_path=ray_token or token_file(),
            node_ip=node_ip,
            model_id=model_id,
            replicas=replicas,
        )
        typer.echo(json.dumps(extra_config(config)) if as_json else shlex.join(server_flags(config)))
        root.err_console.print(
            f"[dim]pool '{cluster}': {nodes} live nodes; SGLang's --hicache-mem-layout must be layer_first, "
            "page_first, page_first_direct or (MHA models only) page_head[/dim]",
            soft_wrap=True,
        )
