"""``kvpool bench``: node-to-node put/get GB/s per tier, read scaling and TTFT, on a local pool or a running one, and
the rendering of its results; ``kvpool bench serve`` and ``kvpool bench chaos``: the serving benches
(``bench/serve.py``, ``bench/chaos.py``), their options passed through."""

import json
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from msgspec import Meta
from rich.console import Group, RenderableType
from rich.table import Table

from kvpool import ray_auth
from kvpool.cli import options, root
from kvpool.core.config import validated
from kvpool.pool.config import MiB, PoolConfig

if TYPE_CHECKING:
    from kvpool.bench.cluster import Results, Settings

#: the local pool bench brings up by default: one more node than ``up``, so "across nodes" has two peers
LOCAL_NODES, LOCAL_DRAM_MIB, LOCAL_NVME_MIB = 3, 512, 512
#: the measurement options default to ``kvpool.bench.cluster.Settings``, read when the command runs (that module
#: imports Ray, too slow to load for every ``kvpool`` call)
_SETTINGS = "Default: the benchmark's own (Settings in bench/cluster.py)."


def _grid(title: str, names: list[str], grid: list[list[float]]) -> Table:
    table = Table(title=title)
    table.add_column("")
    for n in names:
        table.add_column(n, justify="right")
    for n, row in zip(names, grid, strict=True):
        table.add_row(n, *(f"{v:.2f}" for v in row))
    return table


def _scaling(r: "Results") -> Table:
    lim = r.limits
    table = Table(title="scaling: DRAM get, each reader from its neighbour, all at once")
    for col in ("readers", "aggregate GB/s", "per reader GB/s", "memcpy GB/s", "TCP GB/s"):
        table.add_column(col, justify="right")
    for point in r.scaling:
        table.add_row(
            str(point["readers"]),
            f"{point['aggregate_gbps']:.2f}",
            f"{point['per_reader_gbps']:.2f}",
            f"{lim['memcpy']:.2f}",
            f"{lim['socket']:.2f}",
        )
    return table


def _ttft(r: "Results") -> Table:
    table = Table(title=f"TTFT, {r.settings['ttft_model']}: prefill on {r.hosts[0]}, decode on {r.hosts[-1]}")
    for col in ("prompt tokens", "cold s", "warm s", "speedup", "reused tokens", "same first token"):
        table.add_column(col, justify="right")
    for t in r.ttft:
        table.add_row(
            f"{t['tokens']:,}",
            f"{t['cold_s']:.3f}",
            f"{t['warm_s']:.3f}",
            f"{t['speedup']:.1f}x",
            f"{t['reused_tokens']:,}",
            "yes" if t["same_token"] else "NO",
        )
    return table


def render_bench(r: "Results") -> RenderableType:
    """This machine's limits, the put and get grids, the scaling table and (when measured) the TTFT table."""
    lim, s = r.limits, r.settings
    limits = (
        f"limits    memcpy (1 thread) {lim['memcpy']:.2f} GB/s · TCP loopback {lim['socket']:.2f} GB/s · "
        f"O_DIRECT disk write {lim['disk_write']:.2f} / read {lim['disk_read']:.2f} GB/s"
    )
    unique = len(set(r.hosts)) == len(r.hosts)
    names = [h if unique else f"{h} ({i[:6]})" for h, i in zip(r.hosts, r.nodes, strict=True)]
    per = f"{s['chunks_per_cell']} x {s['size'] // 2**20} MiB chunks"
    grids = [("put GB/s: writer (row) into holder (column)", r.put)]
    grids += [(f"get {t} GB/s: chunks held by (row), read by (column)", g) for t, g in r.get.items()]
    parts: list[RenderableType] = [limits, *(_grid(f"{title}; {per}", names, g) for title, g in grids), _scaling(r)]
    if r.ttft:
        parts.append(_ttft(r))
    return Group(*parts)


_Lengths = tuple[Annotated[int, Meta(ge=1, description="a prompt length > 0, as in 1024,4096 ('' to skip)")], ...]


def parse_lengths(ttft: str) -> tuple[int, ...]:
    """``--ttft``: prompt lengths like ``1024,4096``; ``''`` for none."""
    return validated(_Lengths, [t.strip() for t in ttft.split(",") if t.strip()], "--ttft", strict=False)


def _settings(
    defaults: "Settings",
    size_mib: int | None,
    mib_per_cell: int | None,
    repeat: int | None,
    ttft: str | None,
    model: str | None,
) -> "Settings":
    """``defaults`` with the options given on the command line."""
    given: dict[str, Any] = {
        "size": None if size_mib is None else size_mib * MiB,
        "per_cell": None if mib_per_cell is None else mib_per_cell * MiB,
        "repeat": repeat,
        "ttft_tokens": None if ttft is None else parse_lengths(ttft),
        "ttft_model": model,
    }
    return replace(defaults, **{k: v for k, v in given.items() if v is not None})


def _measure(pool: PoolConfig, settings: "Settings") -> "Results":
    """Run the benchmark on ``pool`` (a driver attached to its Ray cluster) behind a progress bar."""
    import ray
    from rich.progress import Progress

    from kvpool.bench import cluster as bench

    count = sum(n["Alive"] for n in ray.nodes())
    with Progress(console=root.console, transient=True) as bar:
        task = bar.add_task("benchmark", total=bench.steps(count, settings))

        def progress(what: str, steps: int) -> None:
            bar.update(task, advance=steps, description=what)

        return bench.run(pool, settings, progress)


def _write(results: "Results", out: Path) -> None:
    from kvpool.bench import cluster as bench

    out.parent.mkdir(parents=True, exist_ok=True)
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps(asdict(results), indent=2))
    try:
        png = bench.plot(results, out.with_suffix(".png"))
        root.console.print(f"figures written to {json_path} and {png}")
    except ImportError:
        root.console.print(f"figures written to {json_path} (no plot: pip install 'kvpool[bench]' for matplotlib)")


_RAY_ADDRESS = typer.Option(
    None, "--ray-address", help="Benchmark the running pool of this Ray cluster (needs --etcd). Default: a local one."
)


bench_app = typer.Typer()
root.app.add_typer(bench_app, name="bench")
#: a serving bench's arguments go to its own parser untouched, ``--help`` included
_PASSED_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@bench_app.callback(invoke_without_command=True)
def bench_command(
    ctx: typer.Context,
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    ray_address: str | None = _RAY_ADDRESS,
    namespace: str = options.NAMESPACE,
    nodes: int = typer.Option(
        LOCAL_NODES, "--nodes", min=1, max=8, help="Nodes of the local cluster (127.0.0.2 and up)."
    ),
    dram_mib: int = typer.Option(
        LOCAL_DRAM_MIB, "--dram-mib", min=64, help="Local cluster: DRAM segment per node, MiB."
    ),
    nvme_mib: int = typer.Option(
        LOCAL_NVME_MIB, "--nvme-mib", min=64, help="Local cluster: NVMe segment per node, MiB."
    ),
    size_mib: int | None = typer.Option(None, "--size-mib", min=1, help=f"Chunk size, MiB. {_SETTINGS}"),
    mib_per_cell: int | None = typer.Option(
        None, "--mib-per-cell", min=1, help=f"Bytes moved per measurement, MiB. {_SETTINGS}"
    ),
    repeat: int | None = typer.Option(
        None, "--repeat", min=1, help=f"Passes per get measurement (the median is shown). {_SETTINGS}"
    ),
    ttft: str | None = typer.Option(
        None, "--ttft", help=f"Prompt lengths for cold/warm TTFT, e.g. 1024,4096; '' skips it. {_SETTINGS}"
    ),
    model: str | None = typer.Option(
        None, "--model", help=f"Model of the TTFT workers: tiny-llama or smollm2-135m. {_SETTINGS}"
    ),
    out: Path = typer.Option(Path("bench/results/cluster"), "--out", help="Writes OUT.json and OUT.png."),
) -> None:
    """Measure a pool: node-to-node put/get GB/s per tier, scaling as nodes read at once, TTFT cold and warm.

    Runs on the embedded default (a local cluster of --nodes nodes on loopback) or, with --ray-address and
    --etcd, on a running pool (one started by 'ray up cluster.yaml', say), which it leaves as it found it.
    Every figure is printed beside this machine's limits measured in the same run: single-thread memcpy,
    a loopback TCP stream and raw O_DIRECT disk I/O.  Results: a table, OUT.json and OUT.png.

    'kvpool bench serve' and 'kvpool bench chaos' are the serving benches (their own --help).
    """
    if ctx.invoked_subcommand is not None:
        return
    from kvpool.bench import cluster as bench
    from kvpool.stack import StackConfig, running_pool

    with root.errors(), ExitStack() as stack:
        settings = _settings(bench.Settings(), size_mib, mib_per_cell, repeat, ttft, model)
        if ray_address:
            pool = _attached(stack, ray_address, etcd, cluster, namespace)
        else:
            local = PoolConfig(
                metadata=options.metadata_config(etcd, cluster), dram_bytes=dram_mib * MiB, nvme_bytes=nvme_mib * MiB
            )
            pool = stack.enter_context(running_pool(StackConfig(pool=local, nodes=nodes), root.ConsoleReport()))
        results = _measure(pool, settings)
        root.console.print(render_bench(results))
        _write(results, out)


def _attached(stack: ExitStack, ray_address: str, etcd: str | None, cluster: str, namespace: str) -> PoolConfig:
    """The running pool of the Ray cluster at ``ray_address``, this process attached to it until ``stack`` closes."""
    import ray

    metadata = options.pool_etcd(etcd, cluster, "bench --ray-address")
    ray_auth.attach(ray_address, namespace=namespace)
    stack.callback(ray.shutdown)
    return PoolConfig(metadata=metadata, namespace=namespace, metrics_port=-1)


@bench_app.command(
    "serve",
    context_settings=_PASSED_THROUGH,
    add_help_option=False,
    short_help="A trace through vLLM engines per KV-cache layer and routing (bench/serve.py; its own --help).",
)
def serve_command(ctx: typer.Context) -> None:
    """A Mooncake trace served through real vLLM engines behind 'kvpool route', per KV-cache layer (none, LMCache,
    Mooncake Store, kvpool) and routing policy: TTFT, throughput, where prompt tokens came from (bench/serve.py;
    'kvpool bench serve --help' lists its options)."""
    from kvpool.bench import serve

    with root.errors():
        serve.main(ctx.args, prog="kvpool bench serve")


@bench_app.command(
    "chaos",
    context_settings=_PASSED_THROUGH,
    add_help_option=False,
    short_help="The trace served on kvpool under faults, each answer checked (bench/chaos.py; its own --help).",
)
def chaos_command(ctx: typer.Context) -> None:
    """The trace served on kvpool while faults are injected (a peer stalled, etcd restarted, bytes flipped, a pool
    node or an engine killed), every answer against a run without faults (bench/chaos.py; 'kvpool bench chaos
    --help' lists its options)."""
    from kvpool.bench import chaos

    with root.errors():
        chaos.main(ctx.args, prog="kvpool bench chaos")
