"""``kvpool advise``: what more or less DRAM and NVMe, or a codec on NVMe, would do to the hit rate, predicted from
the chunk lookups clients sampled (``KVPOOL_ACCESS_LOG``) with a miss-ratio curve of prefix lookups over one LRU
stack per node (see kvpool.pool.reuse)."""

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer
from msgspec import Meta
from rich.table import Table

from kvpool.cli import connect, options, root
from kvpool.cli.figures import fig
from kvpool.core.config import Rule, obey, validated
from kvpool.core.types import Tier
from kvpool.pool.advisor import MissRatioCurve, curve_of_log, read_access_logs, tier_hits
from kvpool.prefill_decode.routing.cost import KNOWN_MODELS, REFERENCE_HARDWARE, CostModel, model_spec

GiB = 2**30
DEFAULT_CODECS = ["fp8-e4m3=2", "int4=3.6"]  #: nominal size ratios against 16-bit KV


#: ``--codec``: a name, ``=``, and a decimal number > 0
_CodecRatio = Annotated[
    str,
    Meta(
        pattern=r"^[^=\s]+=(?!0*\.?0*\Z)(\d+\.?\d*|\.\d+)\Z",
        description="NAME=RATIO, RATIO how many times smaller the codec stores a chunk (a number > 0): e.g. int4=3.6",
    ),
]


def _codecs(specs: list[str]) -> list[tuple[str, float]]:
    return [
        (name, float(ratio))
        for name, _, ratio in (s.partition("=") for s in validated(list[_CodecRatio], specs, "--codec"))
    ]


_CAPACITIES = (Rule("either", "--dram-gib and --nvme-gib", "--etcd", "the etcd of a running pool to read them from"),)


def capacities(dram_gib: float | None, nvme_gib: float | None, etcd: str | None, cluster: str) -> tuple[float, float]:
    """``(DRAM, NVMe)`` bytes to predict around: as given, else the live nodes' segments of the pool at ``etcd``."""
    if dram_gib is not None and nvme_gib is not None:
        return dram_gib * GiB, nvme_gib * GiB
    obey(_CAPACITIES, {"--etcd": options.metadata_config(etcd, cluster).endpoints})  # not both sizes: here
    with connect.running_cache(etcd, cluster, "advise") as cache:
        nodes = cache.nodes()
    dram = dram_gib * GiB if dram_gib is not None else float(sum(n.capacity(Tier.DRAM) for n in nodes))
    nvme = nvme_gib * GiB if nvme_gib is not None else float(sum(n.capacity(Tier.NVME) for n in nodes))
    return dram, nvme


def rows(
    curve: MissRatioCurve, dram: float, nvme: float, step_dram: float, step_nvme: float, codecs: list[tuple[str, float]]
) -> list[tuple[str, float, float, float]]:
    """``(configuration, DRAM bytes, NVMe bytes, NVMe ratio)`` to predict: now, each tier up and down a step, and
    each codec on NVMe."""
    out = [("now", dram, nvme, 1.0), (f"DRAM +{step_dram / GiB:g} GiB", dram + step_dram, nvme, 1.0)]
    if dram - step_dram > 0:
        out.append((f"DRAM -{step_dram / GiB:g} GiB", dram - step_dram, nvme, 1.0))
    out.append((f"NVMe +{step_nvme / GiB:g} GiB", dram, nvme + step_nvme, 1.0))
    if nvme - step_nvme >= 0 and nvme:
        out.append((f"NVMe -{step_nvme / GiB:g} GiB", dram, nvme - step_nvme, 1.0))
    out += [(f"NVMe codec {name} ({ratio:g}x smaller)", dram, nvme, ratio) for name, ratio in codecs if nvme]
    return out


def plot(curve: MissRatioCurve, dram: float, nvme: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max([*(d * curve.nodes for d in curve.distances), int(dram + nvme) * 4, GiB])
    sizes = [top * (i / 200) for i in range(1, 201)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s / GiB for s in sizes], [100 * curve.hit_ratio(s) for s in sizes], label="predicted hit rate (LRU)")
    ax.axvline(dram / GiB, color="tab:green", linestyle="--", label="DRAM now")
    ax.axvline((dram + nvme) / GiB, color="tab:orange", linestyle="--", label="DRAM + NVMe now")
    ax.axhline(100 * curve.ceiling(), color="grey", linestyle=":", label="ceiling (every chunk kept)")
    ax.set_xlabel("pool capacity (GiB of chunk bytes, all nodes)")
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title("kvpool advise: miss-ratio curve of the sampled lookups")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _capacity(tier: str) -> Any:
    """The ``--dram-gib`` / ``--nvme-gib`` option."""
    return typer.Option(
        None,
        f"--{tier.lower()}-gib",
        min=0,
        show_default=False,
        help=f"{tier} the pool has now, GiB, all nodes together (default: what the running pool at --etcd has).",
    )


def advice_table(
    curve: MissRatioCurve,
    rate: float,
    sampled: int,
    total: int,
    configurations: Iterable[tuple[str, float, float, float]],
    object_bytes: float,
    cost: CostModel | None,
) -> Table:
    """One row per configuration (name, DRAM bytes, NVMe bytes, NVMe codec ratio): the hits of each tier, what is
    recomputed, and with a cost model the prefill time the hits save over the ``total`` lookups."""
    stacks = f"{curve.nodes} nodes, one LRU stack each" if curve.nodes > 1 else "one LRU stack"
    table = Table(title=f"predicted from {sampled:,} sampled key lookups of {total:,} (rate {rate:g}; {stacks})")
    columns = ["configuration", "DRAM", "NVMe", "DRAM hits", "NVMe hits", "recomputed"]
    for col in columns + (["prefill saved"] if cost else []):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for name, d, n, ratio in configurations:
        hits = tier_hits(curve, d, n, ratio)
        row = [name, f"{d / GiB:g} GiB", f"{n / GiB:g} GiB"]
        row += [f"{hits.dram:.1%}", f"{hits.nvme:.1%}", f"{hits.recomputed:.1%}"]
        if cost is not None:
            per_byte = hits.dram * cost.saved_per_byte_s("dram") + hits.nvme * cost.saved_per_byte_s("nvme", ratio)
            row.append(f"{fig(total * object_bytes * per_byte)} s")
        table.add_row(*row)
    return table


LOGS = typer.Argument(
    ...,
    exists=True,
    dir_okay=False,
    help="Access logs the engines wrote with KVPOOL_ACCESS_LOG=DIR set (DIR/access-*.jsonl), all of them.",
)
STEP_GIB = typer.Option(
    0.0, "--step-gib", min=0, help="GiB to add and take away per row (default: a quarter of each tier)."
)
CODEC = typer.Option(
    DEFAULT_CODECS, "--codec", help="An NVMe codec to try, NAME=RATIO: how many times smaller it stores a chunk."
)
PNG = typer.Option(Path("kvpool-advise.png"), "--png", help="Where to write the miss-ratio curve.")
MODEL = typer.Option(
    "",
    "--model",
    help=f"Also predict the prefill time the hits save, for this model ({', '.join(KNOWN_MODELS)}): computing "
    "the KV a hit holds against reading it from its tier.",
)
ONE_STACK = typer.Option(
    False,
    "--one-stack",
    help="Model the pool as one LRU stack (the whole pool's bytes), not one per node as the logs name them.",
)


@root.app.command()
def advise(
    logs: list[Path] = LOGS,
    dram_gib: float | None = _capacity("DRAM"),
    nvme_gib: float | None = _capacity("NVMe"),
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    step_gib: float = STEP_GIB,
    codec: list[str] = CODEC,
    png: Path = PNG,
    model: str = MODEL,
    one_stack: bool = ONE_STACK,
    tflops: float | None = typer.Option(None, "--tflops", help=options.TFLOPS_HELP),
    dram_gbps: float | None = options.gbps_option("dram", "DRAM"),
    nvme_gbps: float | None = options.gbps_option("nvme", "NVMe"),
) -> None:
    """Predict the hit rate of DRAM and NVMe for more or less of each and for NVMe codecs, from sampled lookups.

    Run the engines with KVPOOL_ACCESS_LOG=DIR (and KVPOOL_ACCESS_RATE, default 0.01) for a while first: every
    client then logs a spatial sample of the chunks it looks up, lookup by lookup, with its node.  The curve is
    exact LRU on that sample (SHARDS), with kvpool's rules: a lookup reuses only the leading chunks the pool holds
    (the prefix rule), and each node is its own LRU stack over the chunks its clients put (when the logs come from
    several nodes; the capacity given or read is split evenly among the nodes the logs name).  A node's tiers
    act as one stack, DRAM on top.  The logs are taken to be written at the capacities given or read: a chunk a
    lookup found missing although it would fit them was being written by a concurrent lookup, and counts as a
    miss at every capacity."""
    with root.errors():
        codecs = _codecs(codec)
        hardware = options.overridden(REFERENCE_HARDWARE, tflops, {"dram": dram_gbps, "nvme": nvme_gbps})
        cost = CostModel(model_spec(model), hardware) if model else None
        log = read_access_logs(str(p) for p in logs)
        accesses, total = log.accesses, log.total
        dram, nvme = capacities(dram_gib, nvme_gib, etcd, cluster)
        curve = curve_of_log(log, per_node=not one_stack, logged_at=dram + nvme)
        step_dram, step_nvme = (step_gib * GiB,) * 2 if step_gib else (dram / 4 or GiB, nvme / 4 or GiB)
        object_bytes = sum(size for _, size in accesses) / max(1, len(accesses))
        configurations = rows(curve, dram, nvme, step_dram, step_nvme, codecs)
        table = advice_table(curve, log.rate, len(accesses), total, configurations, object_bytes, cost)
        root.console.print(table)
        if cost is not None:
            root.console.print(
                f"prefill saved: {model} on {hardware.source} figures, over the {total:,} lookups the logs stand for "
                f"(objects of {object_bytes / 2**20:.2f} MiB on average): each hit skips computing its KV (2·P FLOPs a "
                "token, no attention term) and pays reading it from its tier"
            )
        root.console.print(f"ceiling (a pool that keeps every chunk): {curve.ceiling():.1%} of lookups hit")
        plot(curve, dram, nvme, png)
        root.console.print(f"miss-ratio curve written to {png}")
