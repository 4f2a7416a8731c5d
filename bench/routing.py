"""Routing on a multi-tenant trace: round-robin, least-loaded and cache-aware lanes, one run, one table.

Starts its own pool (embedded etcd, a local Ray cluster of ``--nodes`` nodes on 127.0.0.2 and up, a ``PoolNode``
per node) and one lane per node (a prefill worker on node ``i``, its decode worker on node ``i + 1``, the
random-weight Llama), then replays one trace, deterministic from ``--seed``:

- **documents**: requests over ``--documents`` shared long documents with Zipf popularity, each with a per-user
  question after it (the document's chunks are shared, the question is not);
- **conversations**: ``--conversations`` multi-turn chats over a document, each turn the previous prompt plus an
  answer and a new question (the whole previous turn is the shared prefix).

Each routing policy replays the trace on a fresh pool (same capacities, new workers), ``--concurrency`` requests
in flight, through :class:`~kvpool.prefill_decode.reference.service.Service` as the HTTP front runs it.  It prints, per
policy, the prefill's hit rate (prompt tokens reloaded / prompt tokens) beside the trace's **reuse ceiling** (the
hit rate of one infinite cache), TTFT p50/p99 and throughput, beside the limits measured in the same run: one
request alone, cold and warm.  Then two checks:

- **the capacity advisor**: the access log of the cache-aware replay (``KVPOOL_ACCESS_LOG``, every lookup sampled)
  gives a miss-ratio curve; its predicted hit ratio at two other capacities beside the hit ratio measured by
  replaying the trace at those capacities (chunk lookups, prefill and decode workers together, as the log sees them);
- **the event stream**: a consumer rebuilds the pool's contents from chunk events alone, disconnected halfway
  through the cache-aware replay and resumed after its last revision, and is compared with the placements in etcd
  (what ``kvpool ls`` lists).

    python bench/routing.py [--requests 160] [--nodes 3] [--dram-mib 32 --nvme-mib 32] [--advise 0.5,0.25] [--seed 0]
                            [--policies round-robin,least-loaded,cache-aware] [--advisor-only] [--keep-logs DIR]

``--advisor-only`` replays only what the advisor check needs (cache-aware at each capacity, no round-robin or
least-loaded lanes, no event consumer); ``--keep-logs DIR`` copies every replay's access logs there.
"""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import ray

from kvpool.bench.advisor_check import ADVISED, held_at_lookup, predicted_hit_ratios
from kvpool.bench.routing_report import console, plot, render
from kvpool.bench.traces import Request, TraceSettings, make_trace, reuse_ceiling
from kvpool.core.types import Tier
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.events import EventStream, replay
from kvpool.metadata.namespace import Namespace
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.prefill_decode.reference.service import Completion, Lane, Service, lane_router
from kvpool.prefill_decode.reference.workers import WorkerConfig, start_lanes
from kvpool.prefill_decode.routing.cost import Hardware
from kvpool.prefill_decode.routing.router import Policy

# -- one replay ----------------------------------------------------------------------------------------------


@dataclass
class Replay:
    policy: str
    dram_mib: int  #: per node
    nvme_mib: int
    ttft_s: list[float] = field(default_factory=list)
    reused_tokens: int = 0
    prompt_tokens: int = 0
    lanes: list[int] = field(default_factory=list)  #: requests per lane
    wall_s: float = 0.0
    lookups: int = 0  #: chunk lookups of every worker (prefill and decode), as the access log sees them
    lookup_hits: int = 0
    log_paths: list[str] = field(default_factory=list)
    events: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def lookup_hit_ratio(self) -> float:
        return self.lookup_hits / self.lookups if self.lookups else 0.0

    def row(self) -> dict[str, Any]:
        t = sorted(self.ttft_s)
        return {
            "policy": self.policy,
            "dram_mib": self.dram_mib,
            "nvme_mib": self.nvme_mib,
            "requests": len(t),
            "hit_rate": self.hit_rate,
            "lookup_hit_ratio": self.lookup_hit_ratio,
            "ttft_p50_s": statistics.median(t),
            "ttft_p99_s": float(np.percentile(t, 99)),
            "throughput_rps": len(t) / self.wall_s,
            "lanes": self.lanes,
            "events": self.events,
        }


@dataclass
class Bench:
    """What stays up across replays: the Ray cluster and etcd, and the worker settings."""

    base: PoolConfig
    nodes: list[str]  #: Ray node ids, sorted by address
    worker: WorkerConfig
    log_dir: str
    concurrency: int
    max_tokens: int = 4


@contextmanager
def lanes_on(bench: Bench, tag: str, dram_mib: int, nvme_mib: int, policy: str) -> Iterator[tuple[Service, PoolConfig]]:
    """A fresh pool of the given capacities (its own cluster name and actors) and a lane per node over it."""
    name = f"routing-{tag}-{uuid.uuid4().hex[:6]}"
    pool = msgspec.structs.replace(
        bench.base,
        dram_bytes=dram_mib * MiB,
        nvme_bytes=nvme_mib * MiB or -1,
        namespace=name,
        metadata=msgspec.structs.replace(bench.base.metadata, cluster=name),
    )
    n = len(bench.nodes)
    with ExitStack() as stack:
        start_pool(pool)
        stack.callback(stop_pool, pool)
        pairs = start_lanes(
            msgspec.structs.replace(bench.worker, pool=pool),
            [(bench.nodes[i], bench.nodes[(i + 1) % n]) for i in range(n)],
        )

        def close() -> None:
            ray.get([w.close.remote() for pair in pairs for w in pair])  # flushes the access logs
            for pair in pairs:
                for w in pair:
                    ray.kill(w)

        stack.callback(close)
        etcd = EtcdClient(pool.metadata)
        stack.callback(etcd.close)
        cache = stack.enter_context(MetadataCache(etcd, Namespace(pool.metadata.cluster)))
        lanes = [Lane(*pair) for pair in pairs]
        yield Service(lanes, model=bench.worker.model, router=lane_router(lanes, cache.replicas, policy)), pool


async def _replay(
    service: Service, trace: list[Request], concurrency: int, max_tokens: int, halfway: threading.Event
) -> tuple[list[Completion], float]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(trace)):
        queue.put_nowait(i)
    done: list[Completion | None] = [None] * len(trace)

    async def client() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            done[i] = await service.complete(trace[i].tokens, max_tokens)
            if sum(d is not None for d in done) >= len(trace) // 2:
                halfway.set()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return [d for d in done if d is not None], time.perf_counter() - t0


def _rebuild_with_a_disconnect(pool: PoolConfig, halfway: threading.Event, finished: threading.Event) -> dict[str, Any]:
    """Follow the chunk events from the start until ``halfway``, disconnect, and once ``finished`` resume after the
    last revision applied; then compare what was rebuilt with the placements etcd holds."""
    etcd = EtcdClient(pool.metadata)
    ns = Namespace(pool.metadata.cluster)
    contents: dict[tuple[bytes, str], Tier | None] = {}
    last, events = 0, 0
    try:
        stream = EventStream(etcd, ns)

        def disconnect() -> None:
            halfway.wait()
            stream.cancel()

        threading.Thread(target=disconnect, daemon=True).start()
        for revision, batch in stream:
            replay(batch, contents)
            last, events = revision, events + len(batch)
        disconnected_at = last
        finished.wait()
        held: dict[tuple[bytes, str], Tier | None] = {}
        for _ in range(10):  # the pool may still demote or reap: compare at one revision, or try again
            marker = etcd.put(ns.sync_marker, uuid.uuid4().bytes)  # moves the stream on to the present
            for rev, batch in EventStream(etcd, ns, after=last, until=marker):
                replay(batch, contents)
                last, events = rev, events + len(batch)
            snapshot_at, stored = next(iter(EventStream(etcd, ns, until=0)))  # the placements, as kvpool ls reads them
            held = {}
            replay(stored, held)
            if snapshot_at == last:
                break
        return {
            "events": events,
            "disconnected_at": disconnected_at,
            "resumed_to": last,
            "replicas": len(held),
            "match": contents == held,
        }
    finally:
        etcd.close()


def run_replay(
    bench: Bench, trace: list[Request], policy: str, dram_mib: int, nvme_mib: int, follow_events: bool = False
) -> Replay:
    out = Replay(policy, dram_mib, nvme_mib)
    before = set(os.listdir(bench.log_dir))
    halfway, finished = threading.Event(), threading.Event()
    with lanes_on(bench, policy, dram_mib, nvme_mib, policy) as (service, pool):
        checker: dict[str, Any] = {}
        thread = None
        if follow_events:
            thread = threading.Thread(
                target=lambda: checker.update(_rebuild_with_a_disconnect(pool, halfway, finished)), daemon=True
            )
            thread.start()
        done, out.wall_s = asyncio.run(_replay(service, trace, bench.concurrency, bench.max_tokens, halfway))
        finished.set()
        if thread is not None:
            thread.join(timeout=120)
            out.events = checker
        out.ttft_s = [d.ttft_s for d in done]
        out.reused_tokens = sum(d.prefill.summary.reused_tokens for d in done)
        out.prompt_tokens = sum(len(d.prompt_tokens) for d in done)
        out.lanes = [sum(d.lane == i for d in done) for i in range(len(service.lanes))]
        stats = ray.get([w.stats.remote() for lane in service.lanes for w in (lane.prefill, lane.decode)])
        out.lookups = sum(s.get("chunks", 0) for s in stats)
        out.lookup_hits = sum(s.get("cached_chunks", 0) for s in stats)
    out.log_paths = sorted(os.path.join(bench.log_dir, f) for f in set(os.listdir(bench.log_dir)) - before)
    return out


def probe(bench: Bench, prompt: list[int]) -> tuple[Hardware, float, float]:
    """The workers' measured cost-model figures, and one request alone: cold (computed), then warm (reloaded)."""
    with lanes_on(bench, "probe", 64, 0, "round-robin") as (service, _):
        hardware = ray.get(service.lanes[0].prefill.hardware.remote())
        one = Service(service.lanes[0], model=bench.worker.model)
        cold = one.complete_sync(prompt, bench.max_tokens).ttft_s
        warm = min(one.complete_sync(prompt, bench.max_tokens).ttft_s for _ in range(3))
    return hardware, cold, warm


# -- the run -------------------------------------------------------------------------------------------------


def _arguments() -> tuple[argparse.Namespace, list[Policy]]:
    """The command line, and the policies to replay (cache-aware among them)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3, help="Ray nodes, one lane each (>= 3 for the issue's goal)")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--documents", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=0, help="requests in flight (0: two per lane)")
    ap.add_argument("--dram-mib", type=int, default=32, help="DRAM per node, MiB")
    ap.add_argument("--nvme-mib", type=int, default=32, help="NVMe per node, MiB")
    ap.add_argument("--advise", default="0.5,0.25", help="the other capacities replayed for the advisor, as factors")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per chunk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--policies",
        default="round-robin,least-loaded,cache-aware",
        help="replayed one after the other, in this order; must include cache-aware",
    )
    ap.add_argument("--json", default="bench/results/routing.json")
    ap.add_argument("--png", default="bench/results/routing.png")
    ap.add_argument(
        "--advisor-only",
        action="store_true",
        help="only the advisor check: cache-aware replays at each capacity, no other policy, no events",
    )
    ap.add_argument("--keep-logs", default="", help="copy each replay's access logs to DIR/<dram>+<nvme>/")
    args = ap.parse_args()
    if args.nodes < 2 or args.requests < 4:
        ap.error("need --nodes >= 2 and --requests >= 4")
    try:
        policies = [Policy.CACHE_AWARE] if args.advisor_only else [Policy(p) for p in args.policies.split(",")]
    except ValueError:
        ap.error(f"--policies: a comma-separated list of {', '.join(p.value for p in Policy)}")
    if Policy.CACHE_AWARE not in policies:
        ap.error("--policies must include cache-aware (the advisor and the event check use its replay)")
    return args, policies


def _advisor(
    bench: Bench, trace: list[Request], args: argparse.Namespace, logged: Replay
) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    """The cache-aware replay at the other capacities (``--advise``) beside the advisor's prediction from
    ``logged``'s access logs, and the predicted curve over pool sizes."""
    n = args.nodes
    measured = [(args.dram_mib, args.nvme_mib, logged)]
    for f in (float(f) for f in args.advise.split(",") if f):
        dram, nvme = max(1, round(args.dram_mib * f)), max(1, round(args.nvme_mib * f))
        with console.status(f"replaying at {dram} + {nvme} MiB per node for the advisor"):
            measured.append((dram, nvme, run_replay(bench, trace, Policy.CACHE_AWARE.value, dram, nvme)))
    if args.keep_logs:
        for dram, nvme, r in measured:
            kept = Path(args.keep_logs) / f"{dram}+{nvme}"
            kept.mkdir(parents=True, exist_ok=True)
            for path in r.log_paths:
                shutil.copy(path, kept)
    at = (n * args.dram_mib * MiB, n * args.nvme_mib * MiB)
    models = predicted_hit_ratios(logged.log_paths, [(n * d * MiB, n * v * MiB) for d, v, _ in measured], at)
    advisor = [
        {
            "dram_mib": d,
            "nvme_mib": v,
            "pool_mib": n * (d + v),
            "measured": r.lookup_hit_ratio,
            "held": held_at_lookup(r.log_paths),
            "predicted": models[ADVISED][i],
            "models": {name: ratios[i] for name, ratios in models.items()},
        }
        for i, (d, v, r) in enumerate(measured)
    ]
    top = max(a["pool_mib"] for a in advisor) * 1.5
    share = args.dram_mib / (args.dram_mib + args.nvme_mib)
    sizes = list(np.linspace(1, top, 40))
    pools = [(m * MiB * share, m * MiB * (1 - share)) for m in sizes]
    along = predicted_hit_ratios(logged.log_paths, pools, at)[ADVISED]
    return advisor, [{"pool_mib": m, "hit": h} for m, h in zip(sizes, along, strict=True)]


def main() -> None:
    args, policies = _arguments()
    from kvpool.metadata.config import MetadataConfig
    from kvpool.servers.etcd import EmbeddedEtcd
    from kvpool.servers.ray_cluster import LocalRayCluster

    trace = make_trace(TraceSettings(args.requests, args.documents, conversations=args.conversations, seed=args.seed))
    ceiling = reuse_ceiling(trace, args.chunk)
    with tempfile.TemporaryDirectory(prefix="kvpool-routing-") as logs, ExitStack() as stack:
        os.environ.update({"KVPOOL_ACCESS_LOG": logs, "KVPOOL_ACCESS_RATE": "1.0"})  # the workers inherit it
        with console.status("starting etcd and a local Ray cluster"):
            etcd = stack.enter_context(EmbeddedEtcd())
            stack.enter_context(LocalRayCluster(nodes=args.nodes))
        ids = sorted((n["NodeManagerAddress"], n["NodeID"]) for n in ray.nodes() if n["Alive"])
        base = PoolConfig(metadata=MetadataConfig(endpoints=(etcd.endpoint,)), metrics_port=-1)
        worker = WorkerConfig(pool=base, chunk_size=args.chunk, torch_threads=1)
        bench = Bench(base, [i for _, i in ids], worker, logs, args.concurrency or 2 * args.nodes)
        with console.status("one request alone, cold and warm; measuring the cost model's figures"):
            hardware, cold, warm = probe(bench, make_trace(replace(TraceSettings(), seed=args.seed + 1))[0].tokens)
        # every replay's workers price alike, and start faster
        bench.worker = msgspec.structs.replace(worker, hardware=hardware)
        rows, replays = [], {}
        for policy in policies:
            with console.status(f"replaying {len(trace)} requests, {policy.value}"):
                events = policy is Policy.CACHE_AWARE and not args.advisor_only
                r = run_replay(bench, trace, policy.value, args.dram_mib, args.nvme_mib, events)
            replays[policy] = r
            rows.append(r.row())
            console.print(f"{policy.value}: hit rate {r.hit_rate:.1%}, TTFT p50 {rows[-1]['ttft_p50_s'] * 1e3:.0f} ms")
        advisor, curve = _advisor(bench, trace, args, replays[Policy.CACHE_AWARE])
    out = {
        "requests": len(trace),
        "nodes": args.nodes,
        "concurrency": bench.concurrency,
        "dram_mib": args.dram_mib,
        "nvme_mib": args.nvme_mib,
        "chunk": args.chunk,
        "seed": args.seed,
        "ceiling": ceiling,
        "limits": {
            "cold_ttft_s": cold,
            "warm_ttft_s": warm,
            "hardware": {"flops": hardware.flops, **hardware.bandwidth},
        },
        "policies": rows,
        "advisor": advisor,
        "curve": curve,
        "events": replays[Policy.CACHE_AWARE].events,
        "trace": {
            "documents": args.documents,
            "conversations": args.conversations,
            "prompt_tokens": sum(len(r.tokens) for r in trace),
        },
    }
    render(out)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    plot(out, Path(args.png))
    console.print(f"figures written to {args.json}, plot to {args.png}")


if __name__ == "__main__":
    main()
