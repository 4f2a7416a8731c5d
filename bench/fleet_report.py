"""bench/fleet.py's report: its tables beside the paper's figures, and its PNG."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpool.bench.fleet_cost import MEASURED
from kvpool.bench.workloads.mooncake import TRACES


@dataclass(frozen=True)
class PaperTrace:
    """One trace's figures in the Mooncake FAST'25 paper (the README beside the traces, corrected): Figure 10, 10
    prefill nodes x 3M tokens, local caches under a prefix-match scheduler against a global pool; Figure 9's label
    at 3M tokens (one cache)."""

    local_hit: float  #: Fig. 10: hit rate of the local caches
    global_hit: float  #: Fig. 10: hit rate of the global pool
    prefill: float  #: Fig. 10: prefill time, global / local
    of_max_at_3m: float  #: Fig. 9: what one 3M-token cache gets, as a part of the trace's maximum

    @property
    def ratio(self) -> float:
        return self.global_hit / self.local_hit


#: by trace; tool & agent's trace is not shipped (quoted for completeness)
PAPER = {
    "conversation": PaperTrace(0.169, 0.375, 0.76, 0.41),
    "tool & agent": PaperTrace(0.420, 0.581, 0.74, 0.75),
    "synthetic": PaperTrace(0.264, 0.622, 0.52, 0.46),
}
PAPER_NODES = 10  #: Fig. 10's prefill nodes (the paper's 16 nodes are its scheduling experiment's, Sec. 4.2)
PAPER_NODE_TOKENS = 3_000_000  #: Fig. 10's cache a node (one node's DRAM in their setup)
PAPER_SETUP = "paper"  #: the ``setup`` of the rows replaying Fig. 10's setup (the others: ``fleet``)

# the configs of the paper part's rows that the report compares
LOCAL = "local, cache-aware"  #: local caches under the prefix-following scheduler (the paper's local bars)
GLOBAL = "kvpool global, DRAM"  #: kvpool's global pool, DRAM only
ONE_CACHE = "one 3M-token cache (1 node)"  #: what a single cache of Fig. 10's size gets (Fig. 9 at 3M)


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
    t = Table(title="the paper (Mooncake FAST'25): Fig. 10, 10 prefill nodes x 3M tokens; Fig. 9, one 3M-token cache")
    cols = ("trace", "local caches", "global pool", "global / local", "prefill time global / local", "Fig. 9: of max")
    for col in cols:
        t.add_column(col, justify="left" if col == "trace" else "right")
    for name, p in PAPER.items():
        t.add_row(
            name if name in TRACES else f"{name} (trace not shipped)",
            _pct(p.local_hit),
            _pct(p.global_hit),
            f"{p.ratio:.2f}x",
            f"{p.prefill:.2f}x",
            f"{100 * p.of_max_at_3m:.0f} %",
        )
    console.print(t)
    _paper_setup(out, console)
    _fleet_setup(out, console)


def _paper_setup(out: dict[str, Any], console: Console) -> None:
    rows = [r for r in out["paper"] if r.get("setup") == PAPER_SETUP]
    if not rows:
        return
    t = Table(
        title=f"the paper's setup replayed: {PAPER_NODES} nodes x {PAPER_NODE_TOKENS / 1e6:g}M tokens (the paper's "
        "local bars are about what one 3M-token cache gets: what compares is the global pool's hit rate, against the "
        "paper's and the infinite cache's, and prefill time global / local)"
    )
    cols = ("trace", "config", "hit rate", "paper", "vs paper", "of infinite", "x local", "prefill time / local")
    for col in cols:
        t.add_column(col, justify="left" if col in ("trace", "config") else "right")
    for row in rows:
        paper = PAPER[row["trace"]]
        local = next(r for r in rows if r["trace"] == row["trace"] and r["config"] == LOCAL)
        quoted = {LOCAL: paper.local_hit, GLOBAL: paper.global_hit, ONE_CACHE: paper.local_hit}[row["config"]]
        note = f" (local; Fig. 9: {100 * paper.of_max_at_3m:.0f} % of max)" if row["config"] == ONE_CACHE else ""
        ratio = row["hit_rate"] / local["hit_rate"] if local["hit_rate"] else float("inf")
        prefill = row["prefill_s"] / local["prefill_s"] if local["prefill_s"] else float("inf")
        ours = {
            GLOBAL: (f"{ratio:.2f}x (paper {paper.ratio:.2f}x)", f"{prefill:.2f}x (paper {paper.prefill:.2f}x)"),
            LOCAL: ("1.00x", "1.00x"),
        }.get(row["config"], ("-", "-"))
        t.add_row(
            row["trace"],
            row["config"],
            _pct(row["hit_rate"]),
            _pct(quoted) + note,
            f"{100 * (row['hit_rate'] - quoted):+.1f} pt",
            _pct(row["hit_rate"] / out["ceiling"][row["trace"]]["replayed"]),
            *ours,
        )
    console.print(t)


def _fleet_setup(out: dict[str, Any], console: Console) -> None:
    rows = [r for r in out["paper"] if r.get("setup") != PAPER_SETUP]
    if not rows:
        return
    nodes, tokens = rows[0]["nodes"], rows[0]["dram_tokens"]
    t = Table(
        title=f"{nodes} nodes x {tokens / 1e6:g}M tokens (kvpool's fleet run, not the paper's Fig. 10 setup): local "
        "caches under each scheduler against kvpool's global pool, then NVMe and S3 below DRAM"
    )
    for col in ("trace", "config", "hit rate", "x local cache-aware", "of infinite", "prefill saved", "hits by path"):
        t.add_column(col, justify="left" if col in ("trace", "config", "hits by path") else "right")
    for row in rows:
        local = next(r for r in rows if r["trace"] == row["trace"] and r["config"] == LOCAL)
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
        f"(paper, Fig. 9: one 3M-token cache gets {_of_max_at_3m(out)} of the maximum)"
    )
    rates = list(out["sweep"][0]["advisor"])
    for col in ("trace", "tokens", "exact", *(f"advisor, log {r:g}: - exact" for r in rates)):
        t.add_column(col, justify="left" if col == "trace" else "right")
    for row in out["sweep"]:
        advised = [f"{_pct(a)}: {100 * (a - row['exact']):+.1f} pt" for a in row["advisor"].values()]
        t.add_row(row["trace"], f"{row['tokens']:.3g}", _pct(row["exact"]), *advised)
    console.print(t)


def _of_max_at_3m(out: dict[str, Any]) -> str:
    names = [n for n in PAPER if any(r["trace"] == n for r in out["sweep"])]
    return " / ".join(f"{100 * PAPER[n].of_max_at_3m:.0f} %" for n in names) + f" ({' / '.join(names)})"


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
    _plot_paper(bx, out["paper"])
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


def _plot_paper(bx: Any, rows: list[dict[str, Any]]) -> None:
    """The paper part's hit rates as bars; the paper's Fig. 10 figure beside each row of its setup (a black mark)."""
    if rows:
        labels = [f"{r['trace'][:4]} {r['nodes']}x: {r['config']}" for r in rows]
        bx.barh(labels, [r["hit_rate"] for r in rows], color="tab:green")
        for label, r in zip(labels, rows, strict=True):
            if r.get("setup") == PAPER_SETUP:
                p = PAPER[r["trace"]]
                bx.plot(p.global_hit if r["config"] == GLOBAL else p.local_hit, label, "k|", ms=12)
    bx.set(
        xlabel="hit rate (black: the paper's Fig. 10)",
        title=f"{PAPER_NODES} nodes x 3M (the paper's setup), then the fleet run",
    )
    bx.tick_params(axis="y", labelsize=6)
