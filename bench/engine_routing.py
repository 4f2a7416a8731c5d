"""Routing over real vLLM engines: round-robin, least-loaded and cache-aware on one trace, in one run, one table.

Starts embedded etcd, a local Ray cluster of ``--nodes`` nodes (127.0.0.2 and up) and, per routing policy, a fresh
pool (a ``PoolNode`` per node) and fresh vLLM engines (CPU), one per node, each with kvpool's connector on its
node and its KV events sent to the front (:class:`~kvpool.prefill_decode.vllm.front.EngineFront`).  Fresh per
policy, so no policy inherits another's caches; the engines' cost models are measured once, on the first
policy's engines (:func:`~kvpool.prefill_decode.vllm.front.calibrate`).

The trace is ``bench/routing.py``'s (documents with Zipf popularity and per-user questions, multi-turn
conversations), replayed closed-loop with ``--concurrency`` requests in flight, one generated token each, so a
request's time is its time to first token, its wait for the engine included.  Per policy: the prompt tokens vLLM
did not compute (its own prefix cache and the pool's chunks together), of them the pool's (the connectors'
loads), TTFT p50/p99, throughput, p50 against round-robin; beside them the limits measured in the same run (one
request alone: cold, from the engine's own cache, from another node's pool DRAM).  Table, JSON and PNG.

    python bench/engine_routing.py [--model smollm2|tiny] [--requests 96] [--nodes 3] [--concurrency 6] [--seed 0]
"""

import argparse
import json
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpool.bench.traces import Request, TraceSettings, make_trace, reuse_ceiling
from kvpool.bench.vllm import model_dir
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.prefill_decode.routing.cost import CostModel
from kvpool.prefill_decode.routing.engine_router import EngineEvents
from kvpool.prefill_decode.routing.router import Policy
from kvpool.prefill_decode.vllm.front import EngineFront, EngineLane, calibrate, model_spec, start_engine_lanes
from kvpool.servers.etcd import EmbeddedEtcd
from kvpool.servers.ray_cluster import LocalRayCluster

console = Console(width=150)


@dataclass
class Replay:
    policy: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  #: not computed by vLLM: its own cache and the pool's
    pool_tokens: int = 0  #: loaded by the connectors
    lanes: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    events: int = 0
    gaps: int = 0

    def row(self, robin_p50: float | None) -> dict[str, Any]:
        p50 = statistics.median(self.ttft_s)
        return {
            "policy": self.policy,
            "requests": len(self.ttft_s),
            "not_computed": self.cached_tokens / self.prompt_tokens,
            "from_pool": self.pool_tokens / self.prompt_tokens,
            "ttft_p50_s": p50,
            "ttft_p99_s": float(np.percentile(self.ttft_s, 99)),
            "vs_round_robin": (robin_p50 or p50) / p50,
            "throughput_rps": len(self.ttft_s) / self.wall_s,
            "lanes": self.lanes,
            "events": self.events,
            "event_gaps": self.gaps,
        }


def replay(front: EngineFront, trace: list[Request], concurrency: int, policy: str) -> Replay:
    out = Replay(policy, lanes=[0] * len(front.lanes))
    before = [lane.engine.ask(connector=True)["totals"].get("loaded_tokens", 0) for lane in front.lanes]
    todo = iter(trace)
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                request = next(todo, None)
            if request is None:
                return
            done = front.complete(request.tokens, max_tokens=1)
            with lock:
                out.ttft_s.append(done.seconds)
                out.prompt_tokens += len(request.tokens)
                out.cached_tokens += done.cached
                out.lanes[done.lane] += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.wall_s = time.perf_counter() - started
    after = [lane.engine.ask(connector=True)["totals"].get("loaded_tokens", 0) for lane in front.lanes]
    out.pool_tokens = int(sum(after) - sum(before))
    out.events, out.gaps = front.events.events, front.events.gaps
    return out


def _pool(args: argparse.Namespace, etcd: str, ray_address: str) -> tuple[PoolConfig, dict[str, Any]]:
    """A pool of its own for one policy's replay, and the engines' connector config for it."""
    metadata = MetadataConfig(endpoints=(etcd,), cluster=f"bench-{uuid.uuid4().hex[:8]}")
    pool = PoolConfig(
        metadata=metadata,
        dram_bytes=args.dram_mib * MiB,
        nvme_bytes=args.nvme_mib * MiB,
        namespace=f"engines-{uuid.uuid4().hex[:8]}",
    )
    extra = {
        "etcd": [etcd],
        "cluster": metadata.cluster,
        "namespace": pool.namespace,
        "ray_address": ray_address,
        "model_id": f"bench-{args.model}",
        "chunk_size": args.chunk,
    }
    return pool, extra


def _limits(cost: CostModel, tokens: int) -> dict[str, float]:
    """What the calibrated cost model says one request of ``tokens`` takes: computed, from the engine's own cache,
    from a peer's pool node; and the bandwidths it was measured at."""
    hw = cost.hardware
    return {
        "cold_s": cost.prefill_s(tokens),
        "engine_cache_s": hw.step_s,
        "peer_s": hw.step_s + cost.transfer_s(tokens, "peer"),
        "dram_gbps": hw.bandwidth["dram"] / 1e9,
        "peer_gbps": hw.bandwidth.get("peer", 0) / 1e9,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    shape = TraceSettings(args.requests, args.documents, conversations=args.conversations, seed=args.seed)
    trace = make_trace(shape)
    longest = max(len(r.tokens) for r in trace)
    path, _, _ = model_dir(args.model, work)
    settings = {"model": str(path), "max_model_len": max(longest, args.calibrate_tokens) + 8}
    spec = model_spec(settings["model"])
    ceiling = reuse_ceiling(trace, args.chunk)
    console.print(
        f"[bold]{args.model}[/]: {len(trace)} requests, {sum(len(r.tokens) for r in trace):,} prompt tokens, "
        f"reuse ceiling {ceiling:.1%}; {args.nodes} engines, {args.concurrency} in flight"
    )
    costs: list[CostModel] = []
    replays: list[Replay] = []
    limits: dict[str, float] = {}
    with EmbeddedEtcd() as etcd, LocalRayCluster(nodes=args.nodes) as cluster:
        for policy in args.policies.split(","):
            pool, extra = _pool(args, etcd.endpoint, cluster.address)
            start_pool(pool)
            events = EngineEvents("tcp://127.0.0.2:*", [f"engine{i}" for i in range(args.nodes)])
            etcd_client = EtcdClient(pool.metadata)
            cache = MetadataCache(etcd_client, Namespace(pool.metadata.cluster)).start()
            lanes: list[EngineLane] = []
            try:
                t0 = time.perf_counter()
                env = {"VLLM_CPU_KVCACHE_SPACE": str(args.engine_cache_gib)}
                lanes = start_engine_lanes(
                    settings, extra, cluster.ips[: args.nodes], events.endpoint, work, env, args.bind_cores
                )
                console.print(f"{policy}: {len(lanes)} engines up in {time.perf_counter() - t0:.0f} s")
                if not costs:
                    costs = calibrate(lanes, spec, args.chunk, tokens=args.calibrate_tokens)
                    limits = _limits(costs[0], args.calibrate_tokens)
                front = EngineFront.over(lanes, events, costs, cache.replicas, args.chunk, policy)
                replays.append(replay(front, trace, args.concurrency, policy))
                console.print(f"  {policy}: p50 {statistics.median(replays[-1].ttft_s) * 1e3:.0f} ms")
            finally:
                for lane in lanes:
                    lane.engine.close()
                events.close()
                cache.close()
                etcd_client.close()
                stop_pool(pool)
    robin = next((r for r in replays if r.policy == Policy.ROUND_ROBIN.value), None)
    robin_p50 = statistics.median(robin.ttft_s) if robin else None
    return {
        "model": args.model,
        "nodes": args.nodes,
        "concurrency": args.concurrency,
        "chunk": args.chunk,
        "requests": len(trace),
        "ceiling": ceiling,
        "engine_cache_gib": args.engine_cache_gib,
        "bind_cores": args.bind_cores,
        "calibrate_tokens": args.calibrate_tokens,
        "limits": limits,
        "policies": [r.row(robin_p50) for r in replays],
    }


def render(out: dict[str, Any]) -> None:
    table = Table(
        title=f"routing over {out['nodes']} vLLM engines ({out['model']}), {out['requests']} requests, "
        f"{out['concurrency']} in flight"
    )
    for col in (
        "policy",
        "not computed",
        "of it from the pool",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "p50 vs RR",
        "req/s",
        "requests per engine",
    ):
        table.add_column(col, justify="right")
    for r in out["policies"]:
        table.add_row(
            r["policy"],
            f"{r['not_computed']:.1%}",
            f"{r['from_pool']:.1%}",
            f"{r['ttft_p50_s'] * 1e3:.0f}",
            f"{r['ttft_p99_s'] * 1e3:.0f}",
            f"{r['vs_round_robin']:.2f}x",
            f"{r['throughput_rps']:.2f}",
            " / ".join(map(str, r["lanes"])),
        )
    lim, n = out["limits"], out["calibrate_tokens"]
    table.add_row(
        "limit",
        f"{out['ceiling']:.1%} ceiling",
        "",
        f"{lim['engine_cache_s'] * 1e3:.0f} engine cache",
        f"{lim['cold_s'] * 1e3:.0f} cold",
        f"{lim['peer_s'] * 1e3:.0f} peer pool",
        "",
        f"one {n}-token request alone",
    )
    console.print(table)
    console.print(
        f"pool reads measured by calibration: own node's DRAM {lim['dram_gbps']:.2f} GB/s, another node's "
        f"{lim['peer_gbps']:.2f} GB/s"
    )


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["policy"] for r in out["policies"]]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [r["ttft_p50_s"] * 1e3 for r in out["policies"]], 0.4, label="TTFT p50")
    ax.bar(x + 0.2, [r["ttft_p99_s"] * 1e3 for r in out["policies"]], 0.4, label="TTFT p99")
    ax.axhline(out["limits"]["engine_cache_s"] * 1e3, color="k", ls=":", label="one request from the engine's cache")
    ax.axhline(
        out["limits"]["cold_s"] * 1e3, color="C3", ls=":", label=f"one {out['calibrate_tokens']}-token prompt cold"
    )
    ax.set_xticks(
        x, [f"{n}\nnot computed {r['not_computed']:.0%}" for n, r in zip(names, out["policies"], strict=True)]
    )
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"TTFT over {out['nodes']} vLLM engines by routing policy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--nodes", type=int, default=3, help="Ray nodes, one engine each")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--documents", type=int, default=12)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=6, help="requests in flight")
    ap.add_argument(
        "--policies", default=",".join(p.value for p in (Policy.ROUND_ROBIN, Policy.LEAST_LOADED, Policy.CACHE_AWARE))
    )
    ap.add_argument("--dram-mib", type=int, default=512, help="pool DRAM per node, MiB")
    ap.add_argument("--nvme-mib", type=int, default=512, help="pool NVMe per node, MiB")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per pool chunk")
    ap.add_argument(
        "--engine-cache-gib",
        type=int,
        default=1,
        help="each engine's own KV cache (VLLM_CPU_KVCACHE_SPACE), GiB: smaller than the trace's working "
        "set, as an engine's HBM is in production",
    )
    ap.add_argument("--calibrate-tokens", type=int, default=1024, help="prompt length the engines are measured with")
    ap.add_argument(
        "--bind-cores",
        action="store_true",
        help="engine i computes on core i alone (as engines on separate hosts would not share cores)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench/results/engine_routing.json")
    ap.add_argument("--png", default="bench/results/engine_routing.png")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpool-engine-routing-") as work:
        out = run(args, Path(work))
    render(out)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    plot(out, Path(args.png))
    console.print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
