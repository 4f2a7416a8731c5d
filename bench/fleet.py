"""The Mooncake FAST'25 traces (conversation, synthetic) replayed through kvpool's own policies at fleet scale.

Simulated nodes run the pool's real ChunkStore (allocator, LRU, watermarks, DRAM <-> NVMe moves) over segments that
hold no bytes, the client's write path and replica order, and the routing policies on the cost model
(bench/fleet_sim.py; LLaMA3-70B, 320 KiB of KV a token, the design's reference hardware figures).  It prints, beside
what the paper reports:

- hit rate against the pool's total capacity (1e4..1e9 tokens), exact replay and `kvpool advise`'s miss-ratio curve
  of the same replay's access logs;
- the paper's Figure 10 setup, 10 nodes x 3M tokens: local caches behind the prefix-following (cache-aware)
  scheduler against kvpool's global pool, and one 3M-token cache alone (what the paper's local bars are about),
  beside the paper's figures: the global pool's hit rate against the paper's and the infinite cache's, prefill time
  global / local against the paper's;
- the fleet run (16 nodes x 3M tokens, not the paper's setup): local caches under each scheduler against the global
  pool, then with NVMe and S3 below DRAM; the prefill GPU time saved; the NVMe below a smaller DRAM (500k tokens a
  node) at which each trace reaches 95 % of its infinite-cache hit rate;
- cost as the fleet grows (16 / 128 / 1,024 nodes): placements published, watch events, etcd bandwidth and store,
  bytes per link kind (bench/fleet_cost.py).

Table, JSON and PNG under bench/results/.

    python bench/fleet.py [--traces conversation,synthetic] [--parts paper,sweep,nvme,cost] [--span-s 3600]
"""

import argparse
import json
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from kvpool.bench import fleet_cost, fleet_report
from kvpool.bench.fleet_sim import FleetResult, FleetSettings, replay
from kvpool.bench.workloads.mooncake import README_CEILING, Request, ceiling, load
from kvpool.pool.advisor import AccessLog, curve_of_log, read_access_logs, usable_bytes
from kvpool.pool.reuse import MissRatioCurve

PARTS = ("paper", "sweep", "nvme", "cost")
SWEEP = tuple(10 ** (e / 2) for e in range(8, 19))  #: 1e4 .. 1e9 tokens, half decades


class Runner:
    """Replays with one progress bar; every replay's wall time kept (``walls``)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.walls: list[tuple[str, int, float]] = []  #: (what, requests, seconds)

    def replay(
        self, what: str, requests: Sequence[Request], settings: FleetSettings, logs: Sequence[Any] = ()
    ) -> FleetResult:
        with Progress(console=self.console, transient=True) as bar:
            task = bar.add_task(what, total=len(requests))
            t0 = time.perf_counter()
            result = replay(requests, settings, logs, lambda n: bar.advance(task, n))
        self.walls.append((what, len(requests), time.perf_counter() - t0))
        return result


def paper_rows(run: Runner, name: str, requests: Sequence[Request], base: FleetSettings) -> list[dict[str, Any]]:
    """The paper's Figure 10 setup (10 nodes x 3M tokens: local caches under the prefix-following scheduler, and the
    global pool) and one of its 3M-token caches alone; then the fleet run (``base``, 16 x 3M tokens): local caches
    under each policy, the global pool, then with NVMe (``base.nvme_tokens``, or 4x DRAM) and S3 below DRAM."""
    dram = replace(base, nvme_tokens=0, s3=False)
    paper = replace(dram, nodes=fleet_report.PAPER_NODES, dram_tokens=fleet_report.PAPER_NODE_TOKENS)
    nvme = base.nvme_tokens or 4 * base.dram_tokens
    fig10, fleet = fleet_report.PAPER_SETUP, "fleet"
    configs = [
        (fig10, fleet_report.LOCAL, replace(paper, shared=False, policy="cache-aware")),
        (fig10, fleet_report.GLOBAL, paper),
        (fig10, fleet_report.ONE_CACHE, replace(paper, nodes=1, shared=False)),
    ]
    configs += [(fleet, f"local, {p}", replace(dram, shared=False, policy=p)) for p in POLICIES]
    configs += [
        (fleet, fleet_report.GLOBAL, dram),
        (fleet, "kvpool global, round-robin", replace(dram, policy="round-robin")),
        (fleet, f"kvpool global, DRAM + NVMe {nvme / 1e6:g}M", replace(base, nvme_tokens=nvme, s3=False)),
        (fleet, f"kvpool global, DRAM + NVMe {nvme / 1e6:g}M + S3", replace(base, nvme_tokens=nvme, s3=True)),
    ]
    rows = []
    for setup, label, settings in configs:
        r = run.replay(f"{name}: {settings.nodes} x {settings.dram_tokens / 1e6:g}M, {label}", requests, settings)
        shape = {"setup": setup, "nodes": settings.nodes, "dram_tokens": settings.dram_tokens}
        rows.append({"trace": name, "config": label, **shape, **r.summary(), "prefill_s": r.prefill_s})
    return rows


POLICIES = ("cache-aware", "least-loaded", "round-robin")


def advisor_curve(
    run: Runner, name: str, requests: Sequence[Request], settings: FleetSettings, rate: float
) -> tuple[FleetResult, MissRatioCurve]:
    """One replay with an access log per node (sampled at ``rate``), and `kvpool advise`'s curve of those logs."""
    with tempfile.TemporaryDirectory(prefix="kvpool-fleet-logs-") as tmp:
        logs = []
        for i in range(settings.nodes):
            directory = Path(tmp) / f"node-{i:04d}"
            directory.mkdir()
            log = AccessLog(str(directory), rate)
            log.node = f"node-{i:04d}"  # the simulated node whose stack its lookups' chunks join
            logs.append(log)
        result = run.replay(f"{name}: logged replay", requests, settings, logs)
        for log in logs:
            log.close()
        sample = read_access_logs(str(p) for p in Path(tmp).glob("*/*.jsonl"))
    return result, curve_of_log(sample, per_node=True)


def sweep_rows(
    run: Runner, name: str, requests: Sequence[Request], base: FleetSettings, rates: Sequence[float]
) -> list[dict[str, Any]]:
    """Hit rate against the pool's total DRAM (``base.nodes`` nodes, no NVMe), exact and from the advisor's curve
    at each access-log sampling rate (of the largest pool's logged replay: any replay's logs give the whole curve)."""
    dram_only = replace(base, nvme_tokens=0, s3=False)
    big = replace(dram_only, dram_tokens=math.ceil(SWEEP[-1] / base.nodes))
    curves = {rate: advisor_curve(run, name, requests, big, rate)[1] for rate in rates}
    rows = []
    for tokens in SWEEP:
        per_node = max(1, round(tokens / base.nodes))
        settings = replace(dram_only, dram_tokens=per_node)
        r = run.replay(f"{name}: {tokens:.2g} tokens", requests, settings)
        pool_bytes = settings.nodes * per_node * settings.token_bytes
        advised = {rate: c.hit_ratio(usable_bytes(pool_bytes, 0)[0]) for rate, c in curves.items()}
        rows.append({"trace": name, "tokens": tokens, "exact": r.hit_rate, "advisor": advised})
    return rows


def nvme_rows(
    run: Runner, name: str, requests: Sequence[Request], base: FleetSettings, dram_tokens: int
) -> list[dict[str, Any]]:
    """The global pool with ``dram_tokens`` of DRAM a node and NVMe of 0, 1, 2, 3, 4, 6, 8, ... times that below it,
    until the hit rate reaches 95 % of the infinite cache's."""
    target = 0.95 * ceiling(list(requests))
    rows = []
    for factor in (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        settings = replace(base, dram_tokens=dram_tokens, nvme_tokens=factor * dram_tokens, s3=False)
        r = run.replay(f"{name}: NVMe {factor}x DRAM", requests, settings)
        rows.append(
            {
                "trace": name,
                "dram_tokens": dram_tokens,
                "nvme_tokens": settings.nvme_tokens,
                "pool_tokens": settings.capacity_tokens,
                "hit_rate": r.hit_rate,
                "target": target,
            }
        )
        if r.hit_rate >= target:
            break
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="conversation,synthetic", help="conversation, synthetic or both")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"what to run, of {', '.join(PARTS)}")
    ap.add_argument("--span-s", type=float, default=None, help="replay only the first S seconds of each trace")
    ap.add_argument("--nodes", type=int, default=16, help="the fleet run's nodes (the paper's setup is 10 x 3M)")
    ap.add_argument("--dram-tokens", type=int, default=3_000_000, help="DRAM per node, in tokens (320 KiB each)")
    ap.add_argument("--nvme-tokens", type=int, default=0, help="NVMe per node in the fleet run (0: 4x DRAM)")
    ap.add_argument("--policy", default="cache-aware", help="the global pool's routing policy")
    ap.add_argument("--nvme-dram-tokens", type=int, default=500_000, help="DRAM a node in the NVMe search (tokens)")
    ap.add_argument("--flush-after-s", type=float, default=300.0, help="NVMe chunks idle this long go to S3")
    ap.add_argument(
        "--access-rates", default="1,0.01", help="the advisor's access-log sampling rates (kvpool's default: 0.01)"
    )
    ap.add_argument("--cost-nodes", default="16,128,1024", help="fleet sizes of the cost table")
    ap.add_argument("--cost-span-s", type=float, default=300.0, help="trace seconds each cost-table replay serves")
    ap.add_argument("--json", default="bench/results/fleet.json")
    ap.add_argument("--png", default="bench/results/fleet.png")
    args = ap.parse_args()
    console = Console(width=200) if not Console().is_terminal else Console()
    run = Runner(console)
    base = FleetSettings(
        nodes=args.nodes,
        dram_tokens=args.dram_tokens,
        nvme_tokens=args.nvme_tokens,
        policy=args.policy,
        flush_after_s=args.flush_after_s,
    )
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    out: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}, "paper": [], "sweep": [], "nvme": []}
    for name in [t.strip() for t in args.traces.split(",") if t.strip()]:
        requests = load(name, span_s=args.span_s)
        out.setdefault("ceiling", {})[name] = {"replayed": ceiling(requests), "readme": README_CEILING[name]}
        if "paper" in parts:
            out["paper"] += paper_rows(run, name, requests, base)
        if "sweep" in parts:
            rates = [float(r) for r in args.access_rates.split(",")]
            out["sweep"] += sweep_rows(run, name, requests, base, rates)
        if "nvme" in parts:
            out["nvme"] += nvme_rows(run, name, requests, base, args.nvme_dram_tokens)
        if "cost" in parts and name == "conversation":
            nodes = [int(n) for n in args.cost_nodes.split(",")]
            out["cost"] = fleet_cost.cost_rows(run, name, base, nodes, args.cost_span_s)
    out["walls"] = [{"what": w, "requests": n, "seconds": s} for w, n, s in run.walls]
    fleet_report.render(out, console)
    for path, write in ((args.json, _write_json), (args.png, fleet_report.plot)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write(out, Path(path))
        console.print(f"wrote {path}")


def _write_json(out: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
