"""``kvpool plan``: the break-even table of reloading a KV prefix from each tier against recomputing it."""

import typer
from rich.console import Group, RenderableType
from rich.table import Table

from kvpool.cli import options, root
from kvpool.cli.figures import fig, si
from kvpool.prefill_decode.routing.cost import KNOWN_MODELS, REFERENCE_HARDWARE, Action, CostModel, Hardware, model_spec

TIMES = "\N{MULTIPLICATION SIGN}"
#: the one-node pool ``--measure`` brings up for the tier bandwidths
MEASURE_DRAM_MIB, MEASURE_NVME_MIB = 256, 512


def render_plan(model: CostModel, tokens: int) -> RenderableType:
    """The model, hardware and prefill lines, the table (one row per tier) and the break-even bandwidth."""
    spec, hw = model.spec, model.hardware
    head = (
        f"model     {spec.name}, {tokens:,} tokens, KV {spec.kv_bytes_per_token:,} B/token\n"
        f"hardware  {hw.source}: {si(hw.flops, 'FLOPS')} effective\n"
        f"prefill   {fig(model.prefill_s(tokens))} s for {si(model.prefill_flops(tokens), 'FLOP')} "
        f"({'with' if model.attention else 'without'} attention)"
    )
    table = Table(title=f"reload the whole {tokens:,}-token prefix, or recompute it")
    for col in ("tier", "bandwidth GB/s", "KV size GB", "reload s", "prefill s", f"speedup ({TIMES})", "verdict"):
        text = col in ("tier", "verdict")
        table.add_column(col, justify="left" if text else "right", no_wrap=text)
    for row in model.break_even(tokens):
        speedup = f"{row.speedup:.1f}{TIMES}" if row.speedup >= 1 else f"{row.speedup:.2g}{TIMES}"
        verdict = f"[green]{row.action.value}[/]" if row.action is Action.RELOAD else f"[yellow]{row.action.value}[/]"
        table.add_row(
            row.tier,
            f"{row.bandwidth / 1e9:.4g}",
            fig(row.kv_bytes / 1e9),
            fig(row.reload_s),
            fig(row.prefill_s),
            speedup,
            verdict,
        )
    tail = f"break-even: reloading wins from any tier faster than {fig(model.break_even_bandwidth(tokens) / 1e9)} GB/s"
    return Group(head, table, tail)


def measure_hardware(probe: str) -> Hardware:
    """FLOPS_eff of ``probe`` in this process, tier bandwidths of a local one-node pool (stopped after)."""
    from kvpool.metadata.config import MetadataConfig
    from kvpool.pool.client import PoolClient
    from kvpool.pool.config import MiB, PoolConfig
    from kvpool.prefill_decode.reference.calibrate import measure_hardware as measure
    from kvpool.prefill_decode.reference.layout import KVLayout
    from kvpool.prefill_decode.reference.model import load_model
    from kvpool.stack import StackConfig, running_pool

    local = PoolConfig(
        metadata=MetadataConfig(cluster="plan-measure"),
        dram_bytes=MEASURE_DRAM_MIB * MiB,
        nvme_bytes=MEASURE_NVME_MIB * MiB,
    )
    busy = f"loading {probe}, measuring its prefill and the pool's tiers"
    with running_pool(StackConfig(pool=local, nodes=1), root.ConsoleReport()) as pool, root.console.status(busy):
        loaded = load_model(probe)
        with PoolClient(pool) as client:
            hardware = measure(loaded, client, KVLayout.of(loaded.model).object_bytes)
    root.console.print(
        f"measured  prefill of {probe}: {hardware.flops / 1e9:.1f} GFLOP/s; "
        + ", ".join(f"{t} {bw / 1e9:.2f} GB/s" for t, bw in hardware.bandwidth.items())
        + " (remote tier: not in this pool)"
    )
    return hardware


@root.app.command()
def plan(
    model: str = typer.Argument("llama-3-70b", help=f"The model: one of {', '.join(KNOWN_MODELS)}."),
    tokens: int = typer.Option(
        32768, "--tokens", min=1, help="Prompt length: the cached prefix reloaded or recomputed."
    ),
    tflops: float | None = typer.Option(
        None,
        "--tflops",
        help=options.TFLOPS_HELP,
    ),
    dram_gbps: float | None = options.gbps_option("dram", "DRAM"),
    nvme_gbps: float | None = options.gbps_option("nvme", "NVMe"),
    remote_gbps: float | None = options.gbps_option("remote", "Remote (S3)"),
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
    with root.errors():
        spec = model_spec(model)
        gbps = {"dram": dram_gbps, "nvme": nvme_gbps, "remote": remote_gbps}
        options.overridden(REFERENCE_HARDWARE, tflops, gbps)  # bad overrides fail before a --measure run
        hardware = options.overridden(measure_hardware(probe) if measure else REFERENCE_HARDWARE, tflops, gbps)
        root.console.print(render_plan(CostModel(spec, hardware, attention=attention), tokens))
