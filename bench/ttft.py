"""Time to first token: cold (full prefill) against warm (KV reloaded from the pool's DRAM or NVMe tier).

Starts its own pool (embedded etcd, a one-node local Ray cluster, one PoolNode) and runs the model in this
process: a random-weight 8-layer Llama (GQA) by default.  For each prompt length it measures

- cold: the whole prompt prefilled (median of --repeat);
- warm from DRAM: the prompt's chunks reloaded layer by layer (pipelined with compute), the last token
  computed for its logits;
- warm from NVMe: the same after every chunk was moved down to the NVMe tier (a hit promotes it back);
- a half hit from DRAM: a prompt sharing only its first half with the cached one — half reloaded, half
  computed, which is where layer-wise loading overlaps the fetch with compute;

and prints beside each the cost model's prediction (FLOPS_eff and tier bandwidths measured at the start of
the run), the floor set by memcpy / raw O_DIRECT disk for moving that much KV, and the share of fetch time
the layer-wise pipeline hid behind compute.  Reloads from the remote tier are measured by bench/remote.py.

    python bench/ttft.py [--lengths 1024,4096,8192] [--repeat 3] [--json bench/results/ttft.json]
"""

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvpool.bench.limits import disk_gbps, memcpy_gbps
from kvpool.core.types import Tier
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.prefill_decode.reference.calibrate import measure_hardware, spec_of
from kvpool.prefill_decode.reference.connector import PoolConnector
from kvpool.prefill_decode.reference.layout import KVLayout
from kvpool.prefill_decode.reference.model import load_model
from kvpool.prefill_decode.reference.reload import Router
from kvpool.prefill_decode.reference.runner import ModelRunner, Prefilled
from kvpool.prefill_decode.routing.cost import CostModel
from kvpool.servers.etcd import EmbeddedEtcd
from kvpool.servers.ray_cluster import LocalRayCluster

console = Console(width=150)


def median(values: list[float]) -> float:
    return statistics.median(values)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    lengths = [int(x) for x in args.lengths.split(",")]
    loaded = load_model(args.model)
    layout = KVLayout.of(loaded.model, chunk_size=args.chunk, layout=args.layout)
    kv_max = max(lengths) * layout.token_bytes
    rows: list[dict[str, Any]] = []
    with EmbeddedEtcd() as etcd, LocalRayCluster(nodes=1), tempfile.TemporaryDirectory() as nvme_dir:
        meta = MetadataConfig(endpoints=(etcd.endpoint,), cluster=f"ttft-{uuid.uuid4().hex[:8]}")
        pool = PoolConfig(
            metadata=meta,
            dram_bytes=max(4 * kv_max, 256 * MiB),
            nvme_bytes=max(4 * kv_max, 512 * MiB),
            nvme_dir=nvme_dir,
            metrics_port=-1,
        )
        start_pool(pool)
        try:
            with PoolClient(pool) as client:
                connector = PoolConnector(client, layout, layout.identity(loaded.name))
                with console.status("measuring FLOPS_eff and tier bandwidths for the cost model"):
                    hardware = measure_hardware(loaded, client, layout.object_bytes)
                cost = CostModel(spec_of(loaded), hardware, attention=True)
                router = Router(connector, cost)
                runner = ModelRunner(loaded, connector)
                copy_gbps = memcpy_gbps(min(kv_max, 256 * MiB))
                _, disk_read_gbps = disk_gbps(nvme_dir, 256 * MiB)
                console.print(
                    f"model {loaded.name} ({layout.token_bytes:,} B of KV per token, {layout.layout} chunks of "
                    f"{args.chunk}); {hardware.source}: {hardware.flops / 1e9:.1f} GFLOP/s, "
                    + ", ".join(f"{t} {bw / 1e9:.2f} GB/s" for t, bw in hardware.bandwidth.items())
                    + f", reload latency {hardware.latency_s * 1e3:.1f} ms"
                    + f"; memcpy {copy_gbps:.1f} GB/s, O_DIRECT read {disk_read_gbps:.2f} GB/s"
                )
                for n in lengths:
                    rows.extend(bench_length(args, n, runner, router, client, cost, copy_gbps, disk_read_gbps))
                connector.close()
        finally:
            stop_pool(pool)
    return rows


def _ttft(runner: ModelRunner, router: Router, prompt: list[int], reuse: bool) -> tuple[float, Prefilled]:
    """Seconds to ``prompt``'s first token, routed by ``router``, reusing the pool's chunks or not; the prefill."""
    t0 = time.perf_counter()
    route = router.route(prompt)
    pre = runner.prefill(prompt, route.keys, route.reuse_chunks if reuse else 0)
    pre.first_token  # noqa: B018 -- the first token is part of TTFT
    return time.perf_counter() - t0, pre


def bench_length(
    args: argparse.Namespace,
    n: int,
    runner: ModelRunner,
    router: Router,
    client: PoolClient,
    cost: CostModel,
    copy_gbps: float,
    disk_gbps: float,
) -> list[dict[str, Any]]:
    """TTFT of an ``n``-token prompt computed, then reused from DRAM, from NVMe and half of it from DRAM: one row
    each, beside what ``cost`` predicts and the floor of copying its KV at ``copy_gbps`` (``disk_gbps``)."""
    vocab = runner.model.config.vocab_size
    tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    assert runner.connector is not None
    token_bytes = runner.connector.layout.token_bytes

    other = torch.randint(0, vocab, (n - n // 2,), generator=torch.Generator().manual_seed(n + 1)).tolist()
    half_tokens = tokens[: n // 2] + other  # shares its first half with `tokens`: a partial hit
    cold_runs, cold_pres = zip(*(_ttft(runner, router, tokens, False) for _ in range(args.repeat)), strict=True)
    runner.save(cold_pres[-1], router.route(tokens).keys)
    keys = [k for chunk in router.route(tokens).keys for k in chunk]
    cold = median(list(cold_runs))
    out = []
    for tier in ("dram", "nvme", "dram, half hit"):
        runs, overlaps = [], []
        prompt = half_tokens if tier.endswith("half hit") else tokens
        for _ in range(args.repeat):
            if tier == "nvme":
                client.move(keys, Tier.NVME)
            s, pre = _ttft(runner, router, prompt, True)
            if pre.reused_tokens == 0:
                raise RuntimeError(f"the {n}-token prompt was not reused from {tier}: {router.route(prompt).decision}")
            runs.append(s)
            overlaps.append(pre.load.overlap if pre.load else 0.0)
        assert prompt is not tokens or pre.first_token == cold_pres[-1].first_token
        warm, reused = median(runs), pre.reused_tokens
        predicted_cold = cost.prefill_s(n)
        predicted_warm = cost.reload_s(reused, tier.split(",")[0]) + cost.prefill_s(n, reused)
        out.append(
            {
                "tokens": n,
                "tier": tier,
                "kv_bytes": n * token_bytes,
                "cold_s": cold,
                "warm_s": warm,
                "speedup": cold / warm,
                "predicted_cold_s": predicted_cold,
                "predicted_warm_s": predicted_warm,
                "predicted_speedup": predicted_cold / predicted_warm,
                "floor_s": reused * token_bytes / ((disk_gbps if tier == "nvme" else copy_gbps) * 1e9),
                "overlap": median(overlaps),
                "cold_runs": list(cold_runs),
                "warm_runs": runs,
            }
        )
        console.print(f"  {n:>6} tokens from {tier}: cold {cold:.3f} s, warm {warm:.4f} s ({cold / warm:.1f}x)")
    return out


def render(rows: list[dict[str, Any]]) -> None:
    table = Table(title="time to first token: recompute vs reload (medians)")
    cols = (
        "tokens",
        "KV MiB",
        "tier",
        "cold s",
        "pred cold s",
        "warm s",
        "pred warm s",
        "speedup",
        "predicted",
        "pred/meas",
        "copy floor s",
        "overlap",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "tier" else "right")
    for r in rows:
        table.add_row(
            f"{r['tokens']:,}",
            f"{r['kv_bytes'] / MiB:.1f}",
            r["tier"],
            f"{r['cold_s']:.3f}",
            f"{r['predicted_cold_s']:.3f}",
            f"{r['warm_s']:.4f}",
            f"{r['predicted_warm_s']:.4f}",
            f"{r['speedup']:.1f}x",
            f"{r['predicted_speedup']:.1f}x",
            f"{r['predicted_speedup'] / r['speedup']:.2f}",
            f"{r['floor_s']:.4f}",
            f"{r['overlap']:.0%}",
        )
    console.print(table)
    console.print(
        "copy floor: the KV bytes at this run's memcpy (DRAM) or O_DIRECT read (NVMe) bandwidth; "
        "overlap: the share of fetch time hidden behind compute by layer-wise loading."
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = sorted({r["tokens"] for r in rows})
    cold = [next(r["cold_s"] for r in rows if r["tokens"] == n) for n in lengths]
    ax.plot(lengths, cold, "o-", label="cold (recompute)")
    for tier, marker in (("dram", "s"), ("nvme", "^"), ("dram, half hit", "d")):
        sel = [r for r in rows if r["tier"] == tier]
        ax.plot([r["tokens"] for r in sel], [r["warm_s"] for r in sel], marker + "-", label=f"warm from {tier}")
        ax.plot(
            [r["tokens"] for r in sel],
            [r["predicted_warm_s"] for r in sel],
            marker + ":",
            alpha=0.6,
            label=f"{tier}, predicted",
        )
    ax.plot(
        lengths,
        [next(r["predicted_cold_s"] for r in rows if r["tokens"] == n) for n in lengths],
        "o:",
        alpha=0.6,
        label="cold, predicted",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s")
    ax.set_title("kvpool: TTFT, recompute vs reload from the pool")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096,8192", help="prompt lengths, tokens")
    ap.add_argument("--model", default="tiny-llama", help="tiny-llama (default) or smollm2-135m")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per chunk")
    ap.add_argument(
        "--layout",
        default="auto",
        help="auto (default: groups of layers up to 512 KiB per object), per-layer (pipelined), groups-of-G "
        "(G layers per object, pipelined) or all-layers",
    )
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per cell; the median is reported")
    ap.add_argument("--json", default="bench/results/ttft.json", help="where to write the figures")
    ap.add_argument("--png", default="bench/results/ttft.png", help="where to write the plot")
    args = ap.parse_args()
    rows = run(args)
    render(rows)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    plot(rows, Path(args.png))
    console.print(f"figures written to {args.json}, plot to {args.png}")


if __name__ == "__main__":
    main()
