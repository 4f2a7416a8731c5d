"""bench/fleet.py's report: its tables beside the paper's figures, and its PNG."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpool.bench.fleet_cost import MEASURED


#: what the paper reports (the README beside the traces: its Figures 9 and 10)
@dataclass(frozen=True)
class Paper:
    ratio: tuple[float, float] = (2.22, 2.38)  #: global pool's hit rate / local caches' (prefix-aware scheduler)
    prefill_saved: float = 0.48  #: "prefill GPU time falls by up to 48 %"
    of_max_at_3m: tuple[float, float] = (0.41, 0.75)  #: a 3M-token cache reaches this part of the maximum


PAPER = Paper()


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _rate(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g} {unit}"
    return f"{x:.3g}"


def render(out: dict[str, Any], console: Console) -> None:
    for name, c in out.get("ceiling", {}).items():
        console.print(f"{name}: infinite-cache hit rate {_pct(c['replayed'])} replayed, {_pct(c['readme'])} per README")
    _paper(out, console)
    _sweep(out, console)
    _nvme(out, console)
    _cost(out, console)
    walls = Table(title="replay wall time (this machine)")
    for col in ("replay", "requests", "s"):
        walls.add_column(col, justify="left" if col == "replay" else "right")
    for w in out.get("walls", []):
        walls.add_row(w["what"], str(w["requests"]), f"{w['seconds']:.1f}")
    console.print(walls)


def _paper(out: dict[str, Any], console: Console) -> None:
    if not out["paper"]:
        return
    t = Table(
        title="16 nodes x 3M tokens: local caches against kvpool's global pool (paper: global / local "
        f"{PAPER.ratio[0]}-{PAPER.ratio[1]}x, prefill time down by up to {PAPER.prefill_saved:.0%})"
    )
    for col in ("trace", "config", "hit rate", "x local cache-aware", "of infinite", "prefill saved", "hits by path"):
        t.add_column(col, justify="left" if col in ("trace", "config", "hits by path") else "right")
    for row in out["paper"]:
        local = next(r for r in out["paper"] if r["trace"] == row["trace"] and r["config"] == "local, cache-aware")
        ratio = row["hit_rate"] / local["hit_rate"] if local["hit_rate"] else float("inf")
        paths = ", ".join(f"{k} {v / row['chunks']:.1%}" for k, v in sorted(row["hits_by_path"].items()))
        inf = out["ceiling"][row["trace"]]["replayed"]
        t.add_row(
            row["trace"],
            row["config"],
            _pct(row["hit_rate"]),
            f"{ratio:.2f}x",
            _pct(row["hit_rate"] / inf),
            _pct(row["prefill_saved"]),
            paths,
        )
    console.print(t)


def _sweep(out: dict[str, Any], console: Console) -> None:
    if not out["sweep"]:
        return
    t = Table(
        title="hit rate against the pool's total DRAM: exact replay and `kvpool advise`'s curve "
        f"(paper: 3M tokens reach {PAPER.of_max_at_3m[0]:.0%}-{PAPER.of_max_at_3m[1]:.0%} of the maximum)"
    )
    rates = list(out["sweep"][0]["advisor"])
    for col in ("trace", "tokens", "exact", *(f"advisor, log {r:g}: - exact" for r in rates)):
        t.add_column(col, justify="left" if col == "trace" else "right")
    for row in out["sweep"]:
        advised = [f"{_pct(a)}: {100 * (a - row['exact']):+.1f} pt" for a in row["advisor"].values()]
        t.add_row(row["trace"], f"{row['tokens']:.3g}", _pct(row["exact"]), *advised)
    console.print(t)


def _nvme(out: dict[str, Any], console: Console) -> None:
    if not out["nvme"]:
        return
    t = Table(title="the global pool with NVMe below DRAM: where it reaches 95 % of the infinite cache's hit rate")
    for col in ("trace", "DRAM a node", "NVMe a node", "pool (tokens)", "hit rate", "target (95 %)"):
        t.add_column(col, justify="left" if col == "trace" else "right")
    for row in out["nvme"]:
        t.add_row(
            row["trace"],
            f"{row['dram_tokens']:.3g}",
            f"{row['nvme_tokens']:.3g}",
            f"{row['pool_tokens']:.3g}",
            _pct(row["hit_rate"]),
            _pct(row["target"]),
        )
    console.print(t)


def _cost(out: dict[str, Any], console: Console) -> None:
    if not out.get("cost"):
        return
    lo64, hi64 = MEASURED.placements_s_64_watches
    lo256, hi256 = MEASURED.placements_s_256_watches
    t = Table(
        title=f"cost as the fleet grows (one etcd measured: {lo64:,}-{hi64:,} placements/s with 64 watches, "
        f"{lo256:,}-{hi256:,} with 256, bench/metadata.py --scale)"
    )
    cols = (
        "nodes",
        "placements/s",
        "watch events / client / s",
        "etcd CPU (cores, fan-out)",
        "etcd writes B/s",
        "etcd store",
        "client cache",
        "peer DRAM B/s a node (max)",
        "NIC B/s",
    )
    for col in cols:
        t.add_column(col, justify="right")
    for row in out["cost"]:
        links = row["link_bytes_s_per_node"]
        cpu = row["etcd_cpu_cores"]
        t.add_row(
            str(row["nodes"]),
            _rate(row["placements_s"]),
            _rate(row["watch_events_per_client_s"]),
            f"{cpu[0]:.2g}-{cpu[1]:.2g}",
            _rate(row["etcd_write_bytes_s"]),
            _rate(row["store_bytes"]) + "B",
            _rate(row["client_cache_bytes"]) + "B",
            f"{_rate(links.get('read DRAM (peer)', 0))} ({_rate(row['peer_out_max_bytes_s'])})",
            _rate(row["nic_bytes_s"]),
        )
    console.print(t)
    links = Table(title="bytes per second a node, by link kind")
    kinds = sorted({k for row in out["cost"] for k in row["link_bytes_s_per_node"]})
    links.add_column("nodes", justify="right")
    for k in kinds:
        links.add_column(k, justify="right")
    for row in out["cost"]:
        links.add_row(str(row["nodes"]), *(_rate(row["link_bytes_s_per_node"].get(k, 0)) for k in kinds))
    console.print(links)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(18, 5))
    for name, color in (("conversation", "tab:blue"), ("synthetic", "tab:orange")):
        rows = [r for r in out["sweep"] if r["trace"] == name]
        if rows:
            xs = [r["tokens"] for r in rows]
            ax.plot(xs, [r["exact"] for r in rows], "o", color=color, label=f"{name}: exact replay")
            for rate, style in zip(rows[0]["advisor"], ("-", ":"), strict=False):
                label = f"{name}: kvpool advise, log {rate:g}"
                ax.plot(xs, [r["advisor"][rate] for r in rows], style, color=color, label=label)
        if name in out.get("ceiling", {}):
            ax.axhline(out["ceiling"][name]["replayed"], ls="--", color=color, lw=0.8)
    ax.axvline(3e6, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", xlabel="pool capacity (tokens)", ylabel="hit rate", title="hit rate against capacity")
    if out["sweep"]:
        ax.legend(fontsize=7)
    rows = out["paper"]
    if rows:
        bx.barh([f"{r['trace'][:4]}: {r['config']}" for r in rows], [r["hit_rate"] for r in rows], color="tab:green")
    bx.set(xlabel="hit rate", title="16 nodes x 3M tokens")
    bx.tick_params(axis="y", labelsize=6)
    cost = out.get("cost", [])
    if cost:
        xs = [r["nodes"] for r in cost]
        cx.plot(xs, [r["placements_s"] for r in cost], "o-", label="placements/s (cluster)")
        cx.plot(xs, [r["watch_events_per_client_s"] * r["nodes"] for r in cost], "s-", label="watch events/s sent")
        lo, hi = MEASURED.placements_s_256_watches
        cx.axhspan(lo, hi, color="grey", alpha=0.3, label="one etcd, 256 watches (measured)")
        cx.set(xscale="log", yscale="log", xlabel="nodes", title="etcd load as the fleet grows")
        cx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
