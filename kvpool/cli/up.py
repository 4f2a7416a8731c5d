"""``kvpool up``: a whole local pool (``kvpool.stack``), checked with a put and a get, the prefill/decode demo
on it, its status; then it leaves, holds until Ctrl-C, or serves HTTP."""

import shlex
from contextlib import ExitStack, closing
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from kvpool import ray_auth
from kvpool.cli import options, root
from kvpool.cli.sglang import launch_line
from kvpool.cli.vllm import serve_line
from kvpool.core.config import Rule, obey, one_of
from kvpool.errors import KvPoolError
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.namespace import Namespace
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.tenants import Tenants
from kvpool.prefill_decode.reference.demo import MODELS, QUESTION
from kvpool.prefill_decode.sglang.config import StorageConfig

if TYPE_CHECKING:
    from kvpool.metadata.config import MetadataConfig
    from kvpool.prefill_decode.reference.demo import DemoRun
    from kvpool.stack import PoolCheck

#: the local pool ``up`` brings up by default: small, so it starts anywhere
LOCAL_NODES, LOCAL_DRAM_MIB, LOCAL_NVME_MIB = 2, 256, 1024


def check_line(check: "PoolCheck") -> str:
    """One line: how long the check's put and get took, what the lookup found, and whether the bytes matched."""
    total = f"{check.chunks * check.chunk_bytes / 2**20:.0f} MiB"
    verdict = "[green]verified[/]" if check.verified else "[red]MISMATCH[/]"
    return (
        f"check     put {total} in {check.put_s * 1e3:.0f} ms, prefix lookup {check.found}/{check.chunks} chunks, "
        f"got {total} back in {check.get_s * 1e3:.0f} ms: {verdict}"
    )


def demo_table(run: "DemoRun") -> Table:
    """The demo's two requests: TTFT, the router's choice, where each worker's KV came from, total time."""
    table = Table(title=f"the same {run.prompt_tokens:,}-token prompt, twice")
    for col in ("request", "TTFT s", "router", "prompt KV", "decode worker's KV", "total s"):
        table.add_column(col, justify="right" if col.endswith(" s") else "left")
    for name, done in (("cold", run.cold), ("warm", run.warm)):
        p, d = done.prefill.summary, done.decode.summary
        where, dwhere = (", ".join(f"{b / 2**20:.1f} MiB {src}" for src, b in x.sources.items()) or "-" for x in (p, d))
        table.add_row(
            name,
            f"{done.ttft_s:.3f}",
            p.action,
            f"{p.reused_tokens} reused ({where}), {p.computed_tokens} computed",
            f"{d.reused_tokens} reused ({dwhere}), {d.computed_tokens} computed",
            f"{done.total_s:.2f}",
        )
    return table


def demo_lines(run: "DemoRun") -> list[str]:
    """The TTFT speedup, the question and answer (models with a tokenizer), a warning if the answers differ."""
    lines = [f"TTFT      cold {run.cold.ttft_s:.3f} s, warm {run.warm.ttft_s:.3f} s: {run.speedup:.1f}x faster"]
    if run.answer:
        lines += [f"question  {QUESTION}", f"answer    {run.answer}"]
    if run.warm.tokens != run.cold.tokens:
        lines.append("[yellow]the warm answer differs from the cold one[/]")
    return lines


def shell_exports(ray_address: str, mode: str, token_path: str, metadata: "MetadataConfig") -> str:
    """The ``export`` line another shell runs to reach this pool: Ray's address, its authentication mode and token
    file, etcd's endpoints.  With it, kvpool's commands and engines attach, and so does a user's own script with a
    plain ``ray.init()`` and ``MetadataConfig.from_env()`` (the README's "Using the pool"; an etcd on TLS needs its
    certificates too, which ``_hold`` says)."""
    from kvpool.metadata.config import ENDPOINTS_ENV

    env = {"RAY_ADDRESS": ray_address, ray_auth.MODE_ENV: mode}
    if token_path:
        env[ray_auth.TOKEN_PATH_ENV] = token_path
    env[ENDPOINTS_ENV] = ",".join(metadata.endpoints)
    return "export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())


def _hold(pool: PoolConfig) -> None:
    """Say how to reach the pool (kvpool status, vLLM, SGLang), then wait for Ctrl-C."""
    import ray

    where = f"--etcd {pool.metadata.endpoints[0]} --cluster {pool.metadata.cluster}"
    if pool.metadata.tls:
        root.console.print(f"etcd is TLS only: export {options.TLS_DIR_ENV}=<the --etcd-tls directory> in that shell")
    node_ip = min(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    ray_address = ray.get_runtime_context().gcs_address
    mode = ray_auth.current_mode()
    token = ray_auth.find_token() if mode == "token" else None
    token_path = str(token.path) if token is not None and token.path is not None else ""
    exports = shell_exports(ray_address, mode, token_path, pool.metadata)
    root.console.print(f"In another shell, first: {exports}", soft_wrap=True, markup=False)
    root.console.print(f"pool up. In another shell: kvpool status {where}")
    args = f"{where} --namespace {pool.namespace} --ray-address {ray_address} --node-ip {node_ip}"
    root.console.print(f"vLLM on it: {serve_line(args)}", soft_wrap=True, markup=False)
    sglang = StorageConfig(
        etcd=pool.metadata.endpoints,
        cluster=pool.metadata.cluster,
        namespace=pool.namespace,
        ray_address=ray_address,
        ray_token_path=token_path,
        node_ip=node_ip,
    )
    root.console.print(f"SGLang on it: {launch_line(sglang)}", soft_wrap=True, markup=False)
    root.console.print("Ctrl-C (or kill) stops it.")
    root.wait_for_interrupt("the pool")


def _tls_etcd(stack: ExitStack, tls_dir: str) -> str:
    """An embedded etcd serving TLS only, with client-certificate authentication, from ``tls_dir`` (the CA and
    certificates are made there if missing); its endpoint."""
    from kvpool.servers.certs import server_files
    from kvpool.servers.etcd import EmbeddedEtcd

    with root.console.status("starting embedded etcd (TLS)"):
        server = stack.enter_context(EmbeddedEtcd(tls=server_files(tls_dir)))
    root.console.print(f"etcd      embedded, {server.url}, TLS with client certificates (CA in {tls_dir})")
    return server.endpoint


def _run(
    pool: PoolConfig,
    stack: ExitStack,
    demo: str,
    serve: int,
    hold: bool,
    lanes: int,
    route: str,
    tenants: Tenants | None = None,
    engine: str = "workers",
) -> None:
    """Everything ``up`` does on the running ``pool``."""
    from kvpool.cli import status  # here, not above: up comes first in --help
    from kvpool.prefill_decode.reference.demo import run_demo
    from kvpool.stack import check_pool, demo_service
    from kvpool.stack import serve as serve_http

    check = check_pool(pool)
    root.console.print(check_line(check))
    if not check.verified:
        raise KvPoolError("the pool returned bytes that differ from what was put; run with --debug and report it")
    report = root.ConsoleReport()
    service = None
    if engine == "vllm":  # checked by up: --serve is given, no tenants
        from kvpool.stack import engine_service, serve_engines

        engines = stack.enter_context(engine_service(pool, MODELS[0], report, lanes, route))
        serve_engines(engines, serve, report)
        return
    if demo != "none" or serve >= 0:
        model = demo if demo != "none" else MODELS[0]
        service = stack.enter_context(demo_service(pool, model, report, lanes, route, tenants))
    if service is not None and demo != "none":
        run = run_demo(service)
        root.console.print(demo_table(run))
        for line in demo_lines(run):
            root.console.print(line)
    etcd = stack.enter_context(closing(EtcdClient(pool.metadata)))  # pool.metadata: with the TLS settings
    with MetadataCache(etcd, Namespace(pool.metadata.cluster)) as cache:
        cache.sync()
        root.console.print(status.render(status.gather(cache)))
    if service is not None and serve >= 0:
        serve_http(service, serve, report)
    elif hold:
        _hold(pool)


#: the panel of what ``up`` does once the pool is up (the others are in options.py)
RUN_PANEL = "What up runs on the pool"

RAY_ADDRESS = typer.Option(
    None,
    "--ray-address",
    help="Attach to this Ray cluster (a pool node on every alive node). Default: start a local one on loopback.",
    rich_help_panel=options.RAY_PANEL,
)
RAY_AUTH = typer.Option(
    "",
    "--ray-auth",
    show_default=False,
    help="The local Ray cluster's authentication: token (the default, unless RAY_AUTH_MODE=disabled is set: a "
    "token generated for this cluster, readable only by you) or disabled (anyone who reaches its ports can run "
    "code on it). An attached cluster (--ray-address) keeps its own.",
    rich_help_panel=options.RAY_PANEL,
)
NODES = typer.Option(
    LOCAL_NODES,
    "--nodes",
    min=1,
    max=8,
    help="Ray nodes of the local cluster (127.0.0.2 and up).",
    rich_help_panel=options.RAY_PANEL,
)
DRAM_MIB = typer.Option(
    LOCAL_DRAM_MIB, "--dram-mib", min=1, help="DRAM segment per node, MiB.", rich_help_panel=options.SEGMENTS_PANEL
)
NVME_MIB = typer.Option(
    LOCAL_NVME_MIB,
    "--nvme-mib",
    min=0,
    help="NVMe segment per node, MiB (0: no NVMe tier).",
    rich_help_panel=options.SEGMENTS_PANEL,
)
DEMO = typer.Option(
    MODELS[0],
    "--demo",
    help=f"Model of the prefill/decode demo: {', '.join(MODELS)}, or 'none' to skip it.",
    rich_help_panel=RUN_PANEL,
)
SERVE = typer.Option(
    -1,
    "--serve",
    min=-1,
    max=65535,
    help=f"Serve OpenAI-style /v1/completions on 127.0.0.1:PORT (0: any port) until Ctrl-C; -1: do not. With --demo "
    f"none it serves {MODELS[0]}.",
    rich_help_panel=RUN_PANEL,
)
LANES = typer.Option(
    1,
    "--lanes",
    min=1,
    max=32,
    help="Prefill -> decode lanes of the demo and --serve: lane i's prefill worker on node i, its decode worker on "
    "the next.",
    rich_help_panel=RUN_PANEL,
)
ROUTE = typer.Option(
    "cache-aware",
    "--route",
    help="How --serve picks a lane when there are several: cache-aware (least predicted TTFT: queued work, then "
    "reload-or-recompute of the cached prefix from that node), least-loaded or round-robin.",
    rich_help_panel=RUN_PANEL,
)
HOLD = typer.Option(
    False,
    "--hold",
    help="Keep the pool up until Ctrl-C (default: check it, run the demo, leave).",
    rich_help_panel=RUN_PANEL,
)
ENGINE = typer.Option(
    "workers",
    "--engine",
    help="What --serve serves with: workers (kvpool's prefill -> decode lanes, transformers) or vllm (one vLLM "
    f"engine of {MODELS[0]} with kvpool's connector per node, --lanes of them, routed by --route over their own "
    "prefix caches, known from their KV events, and the pool's contents; the demo is skipped).",
    rich_help_panel=RUN_PANEL,
)
TENANTS = typer.Option(
    "",
    "--tenants",
    help="A tenants file (TOML; kvpool tenants check FILE): --serve then answers only requests with a tenant's "
    "API key (Authorization: Bearer KEY), keys each tenant's chunks from its own secret, and every node enforces "
    "the tenants' quotas.",
    rich_help_panel=RUN_PANEL,
)


_VLLM_SERVES = (
    Rule("needs", "--engine vllm", "--serve PORT", "it serves over vLLM engines"),
    Rule("excludes", "--engine vllm", "--tenants", "tenants are served by the workers' front only"),
)
_TLS_ETCD = (
    Rule(
        "needs",
        "etcd TLS files (KVPOOL_ETCD_CA...)",
        "--etcd",
        "pass --etcd-tls DIR to start the embedded etcd with TLS, or --etcd for a running one",
    ),
)


def _check_choices(demo: str, route: str, ray_auth_mode: str, engine: str, serve: int, tenants: str) -> None:
    """``up``'s options that name one of a few values, and the one combination it cannot run: checked before
    anything starts."""
    from kvpool.prefill_decode.routing.router import Policy

    Policy.of(route, "--route")
    if ray_auth_mode:
        ray_auth.requested_mode(ray_auth_mode)
    one_of((*MODELS, "none"), demo, "--demo")
    one_of(("workers", "vllm"), engine, "--engine")
    obey(_VLLM_SERVES, {"--engine vllm": engine == "vllm", "--serve PORT": serve >= 0, "--tenants": tenants})


def _metadata(stack: ExitStack, etcd: str | None, etcd_tls: str | None, cluster: str) -> "MetadataConfig":
    """The pool's etcd: the one given, else an embedded one (with TLS from ``etcd_tls`` if given)."""
    if etcd_tls and not etcd:
        etcd = _tls_etcd(stack, etcd_tls)
    metadata = options.metadata_config(etcd, cluster, etcd_tls)
    obey(_TLS_ETCD, {"etcd TLS files (KVPOOL_ETCD_CA...)": metadata.tls, "--etcd": metadata.endpoints})
    return metadata


@root.app.command()
def up(
    etcd: str | None = options.ETCD,
    etcd_tls: str | None = options.ETCD_TLS,
    cluster: str = options.CLUSTER,
    ray_address: str | None = RAY_ADDRESS,
    ray_auth_mode: str = RAY_AUTH,
    nodes: int = NODES,
    dram_mib: int = DRAM_MIB,
    nvme_mib: int = NVME_MIB,
    nvme_dir: str = options.NVME_DIR,
    nvme_codec: str = options.NVME_CODEC,
    s3_bucket: str = options.S3_BUCKET,
    s3_endpoint: str = options.S3_ENDPOINT,
    s3_codec: str = options.S3_CODEC,
    flush_after: float = options.FLUSH_AFTER,
    demo: str = DEMO,
    serve: int = SERVE,
    lanes: int = LANES,
    route: str = ROUTE,
    hold: bool = HOLD,
    engine: str = ENGINE,
    tenants: str = TENANTS,
) -> None:
    """Bring a pool up, check it with a put and a get, run the prefill/decode demo, print the status.

    The embedded default needs nothing running: an etcd on a free loopback port, a local Ray cluster of
    --nodes nodes on 127.0.0.2 and up, and one PoolNode actor per node with a DRAM segment (shared
    memory) and an NVMe segment (a file in a temp dir).  The demo starts a prefill worker on the first
    node and a decode worker on the last, asks SmolLM2 about a long document twice, and prints the time
    to first token cold (computed) and warm (reloaded from the pool), and where the KV came from.
    All of it stops on exit unless --hold or --serve.
    """
    from kvpool.stack import StackConfig, running_pool

    with root.errors(), ExitStack() as stack:
        _check_choices(demo, route, ray_auth_mode, engine, serve, tenants)
        tenants_file = Tenants.load(tenants) if tenants else None
        pool = PoolConfig(
            metadata=_metadata(stack, etcd, etcd_tls, cluster),
            dram_bytes=dram_mib * MiB,
            nvme_bytes=nvme_mib * MiB or -1,
            nvme_dir=nvme_dir,
            nvme_codec=nvme_codec,
            remote=options.remote_config(s3_bucket, s3_endpoint, s3_codec, flush_after),
            quotas=tenants_file.quotas() if tenants_file else {},
        )
        config = StackConfig(pool=pool, nodes=nodes, ray_address=ray_address or "", ray_auth=ray_auth_mode.lower())
        running = stack.enter_context(running_pool(config, root.ConsoleReport()))
        _run(running, stack, demo, serve, hold, lanes, route, tenants_file, engine)
