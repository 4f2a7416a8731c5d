"""What ``bench/routing.py`` prints and plots from its figures (the JSON it writes): the policies' table beside the
trace's ceiling and one request alone, the advisor's predictions beside the replays, and the PNG."""

from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpool.bench.advisor_check import ADVISED, MODELS

console = Console(width=150)


def render(out: dict[str, Any]) -> None:
    lim = out["limits"]
    table = Table(
        title=f"routing: {out['requests']} requests, {out['nodes']} lanes (one per node), "
        f"{out['concurrency']} in flight, {out['dram_mib']} + {out['nvme_mib']} MiB DRAM + NVMe per node"
    )
    for col in (
        "policy",
        "hit rate",
        "of ceiling",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "p50 vs round-robin",
        "req/s",
        "requests per lane",
    ):
        table.add_column(col, justify="left" if col in ("policy", "requests per lane") else "right")
    robin = next((r for r in out["policies"] if r["policy"] == "round-robin"), out["policies"][0])
    for r in out["policies"]:
        table.add_row(
            r["policy"],
            f"{r['hit_rate']:.1%}",
            f"{r['hit_rate'] / out['ceiling']:.0%}",
            f"{r['ttft_p50_s'] * 1e3:.0f}",
            f"{r['ttft_p99_s'] * 1e3:.0f}",
            f"{robin['ttft_p50_s'] / r['ttft_p50_s']:.2f}x",
            f"{r['throughput_rps']:.2f}",
            " / ".join(map(str, r["lanes"])),
        )
    table.add_row(
        "limit",
        f"{out['ceiling']:.1%}",
        "ceiling",
        f"{lim['warm_ttft_s'] * 1e3:.0f} warm",
        f"{lim['cold_ttft_s'] * 1e3:.0f} cold",
        "",
        "",
        "one request alone",
    )
    console.print(table)
    _render_advisor(out)


def _render_advisor(out: dict[str, Any]) -> None:
    adv = Table(title="capacity advisor: predicted from the first replay's access log vs replayed (prefix lookups)")
    for col in ("DRAM + NVMe per node", "pool", "measured", "objects held at lookup", *MODELS):
        adv.add_column(col, justify="right")
    for a in out["advisor"]:
        adv.add_row(
            f"{a['dram_mib']} + {a['nvme_mib']} MiB",
            f"{a['pool_mib']} MiB",
            f"{a['measured']:.1%}",
            f"{a['held']:.1%}",
            *(f"{p:.1%} ({(p - a['measured']) * 100:+.1f})" for p in a["models"].values()),
        )
    console.print(adv)
    console.print(f"kvpool advise uses the last model ({ADVISED}); each column adds one cause to the one before")
    ev = out["events"]
    if not ev:
        return
    console.print(
        f"events: {ev.get('events', 0):,} chunk events, disconnected at revision {ev.get('disconnected_at')}, resumed to "
        f"{ev.get('resumed_to')}: rebuilt contents {'MATCH' if ev.get('match') else 'DIFFER FROM'} the {ev.get('replicas', 0):,} "
        "replicas in etcd (kvpool ls)"
    )


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["policy"] for r in out["policies"]]
    x = np.arange(len(names))
    a.bar(x - 0.2, [r["ttft_p50_s"] * 1e3 for r in out["policies"]], 0.4, label="TTFT p50")
    a.bar(x + 0.2, [r["ttft_p99_s"] * 1e3 for r in out["policies"]], 0.4, label="TTFT p99")
    a.axhline(out["limits"]["warm_ttft_s"] * 1e3, color="k", ls=":", label="one warm request alone")
    a.set_xticks(x, [f"{n}\nhit {r['hit_rate']:.0%}" for n, r in zip(names, out["policies"], strict=True)])
    a.set_ylabel("ms")
    a.set_yscale("log")
    a.legend()
    a.set_title(f"TTFT by routing policy (reuse ceiling {out['ceiling']:.0%})")
    pts = out["advisor"]
    b.plot([p["pool_mib"] for p in out["curve"]], [p["hit"] for p in out["curve"]], label="advisor: predicted")
    b.scatter(
        [p["pool_mib"] for p in pts],
        [p["measured"] for p in pts],
        color="C3",
        zorder=3,
        label="replayed: prefix lookups",
    )
    b.scatter(
        [p["pool_mib"] for p in pts],
        [p["held"] for p in pts],
        color="C2",
        marker="x",
        zorder=3,
        label="replayed: objects held at lookup",
    )
    b.set_xlabel("pool capacity, MiB (DRAM + NVMe, all nodes)")
    b.set_ylabel("chunk lookup hit ratio")
    b.set_ylim(0, 1)
    b.legend()
    b.set_title("capacity advisor vs replay")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
