"""Metadata at scale: simulated nodes publishing placements and clients watching them, against one etcd.

Run by ``python bench/metadata.py --scale``.  For each node count (default 1, 4, 16, 64) that many new simulated
nodes join: each registers through ``NodeRegistry`` (its own lease, kept alive by its ``LeaseKeeper`` thread, its own
``EtcdClient``) and publishes its share of the phase's placements through ``PlacementStore.publish``, one
transaction of ``txn_max_ops`` placements at a time, one in flight per node, as a node publishing puts does.  Nodes
stay, so the store grows to ``--chunks`` placements by the last phase.  The same nodes then write as many
pre-encoded puts in bare transactions of the same size (keys under ``<root>/raw/``, deleted after): etcd's own rate
at that batch size and concurrency, the floor beside kvpool's.

Watching: ``--caches`` real ``MetadataCache`` instances (each keeps a full, decoded copy, as a client does) and
``--watchers`` bare watch streams that receive every event and keep nothing: what etcd's fan-out costs per watcher
without a client's memory.  The watches of one process share one gRPC channel (one ``EtcdClient``).  Lag: each
publish transaction is stamped with its revision and the time its answer reached the node (``CLOCK_MONOTONIC``, one
clock for every process of the host); each watch records when each revision became visible in it; lag = visible -
acknowledged, 0 when the watch saw it first.

Processes (multiprocessing spawn; ``bench/metadata_sim.py``): nodes are threads of ``--publisher-procs`` processes, watches are threads of
``--watch-procs`` processes, and the parent only orchestrates; at the end it times a new client's snapshot and
measures another under ``tracemalloc`` (memory per chunk).  Every process shares this machine's cores with etcd.
"""

import argparse
import bisect
import gc
import json
import multiprocessing as mp
import os
import statistics
import time
import tracemalloc
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pyetcd
from msgspec import Meta
from rich.console import Console
from rich.table import Table

from kvpool.bench.limits import proc_cpu_s
from kvpool.bench.metadata_sim import Stamp, publisher, watcher
from kvpool.core.config import Config, NonNegative, Positive, Rule, validated
from kvpool.errors import ConfigError, MetadataUnavailable
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient, prefix_end
from kvpool.metadata.config import MetadataConfig, parse_endpoint
from kvpool.metadata.namespace import Namespace

COLLECT_TIMEOUT_S = 300.0  #: how long the parent waits for every watch to catch up with a phase


_NodeCounts = Annotated[tuple[Positive, ...], Meta(min_length=1, description="ints >= 1, e.g. 1,4,16,64")]


class ScaleSettings(Config, frozen=True):
    """One scale run; the issue's full configuration is ``chunks=1_000_000`` and 256 watches in all."""

    node_counts: _NodeCounts = (1, 4, 16, 64)  #: new nodes joining in each phase
    chunks: Positive = 100_000  #: placements in etcd after the last phase, split evenly over the phases
    caches: NonNegative = 4  #: real MetadataCache instances
    watchers: NonNegative = 60  #: bare watch streams
    publisher_procs: Positive = 2
    watch_procs: Positive = 1
    lease_ttl_s: Positive = 10  #: of each simulated node (longer than the pool's 5 s: the keepers share busy cores)

    rules = (Rule("either", "caches", "watchers", "at least one watch, since lag is measured by them"),)

    def check(self) -> None:
        if self.chunks < len(self.node_counts) * max(self.node_counts):
            raise ConfigError(f"--chunks {self.chunks} is fewer than one placement per node per phase; raise it")


# -- the parent ---------------------------------------------------------------------------------------------


def _ask(conns: list[Connection], msg: Any) -> list[Any]:
    for c in conns:
        c.send(msg)
    return [c.recv() for c in conns]


def _lags(stamps: list[Stamp], seen: list[Stamp]) -> list[float]:
    """For each acknowledged revision, how long after its acknowledgement ``seen`` first showed it."""
    revs = [r for r, _ in seen]
    out = []
    for revision, acked in stamps:
        i = bisect.bisect_left(revs, revision)
        if i < len(seen):
            out.append(max(0.0, seen[i][1] - acked))
    return out


def _pcts(samples: list[float]) -> dict[str, float]:
    if len(samples) < 2:  # one watch saw one revision: its lag is both
        one = samples[0] * 1e3 if samples else float("nan")
        return {"p50_ms": one, "p99_ms": one}
    return {"p50_ms": statistics.median(samples) * 1e3, "p99_ms": statistics.quantiles(samples, n=100)[98] * 1e3}


def _collect(watchers: list[Connection], revision: int) -> tuple[dict[str, list[list[Stamp]]], dict[str, int]]:
    answers = _ask(watchers, ("collect", revision, COLLECT_TIMEOUT_S))
    if not all(ok for ok, _ in answers):
        raise MetadataUnavailable(f"watches did not reach revision {revision} within {COLLECT_TIMEOUT_S:.0f} s")
    seen: dict[str, list[list[Stamp]]] = {"cache": [], "bare": []}
    resyncs = {"cache": 0, "bare": 0}
    for _, watches in answers:
        for kind, stamps, resynced in watches:
            seen[kind].append(stamps)
            resyncs[kind] += resynced
    return seen, resyncs


def _lag_figures(stamps: list[Stamp], seen: dict[str, list[list[Stamp]]]) -> dict[str, dict[str, float]]:
    return {
        kind: _pcts([lag for s in streams for lag in _lags(stamps, s)]) for kind, streams in seen.items() if streams
    }


def _phase(
    pubs: list[Connection],
    watchers: list[Connection],
    etcd: EtcdClient,
    etcd_pid: int | None,
    phase: int,
    nodes: int,
    count: int,
) -> dict[str, Any]:
    """``nodes`` new nodes publish ``count`` placements in all, then as many bare puts; the phase's figures."""
    ids = [f"sim-{phase}-{i}" for i in range(nodes)]
    active = [c for i, c in enumerate(pubs) if ids[i :: len(pubs)]]
    per_node = count // nodes
    for i, c in enumerate(active):
        c.send(("phase", ids[i :: len(pubs)], per_node))
    for c in active:
        c.recv()  # registered, placements built
    cpu0 = proc_cpu_s(etcd_pid) if etcd_pid else 0.0
    rounds = _ask(active, "go")
    stamps = [s for r in rounds for s in r["stamps"]]
    seen, _ = _collect(watchers, etcd.revision())
    etcd_cpu = proc_cpu_s(etcd_pid) - cpu0 if etcd_pid else float("nan")
    raw = _ask(active, "go")
    for c in active:
        c.recv()  # the bare puts deleted again
    _collect(watchers, etcd.revision())  # drain the bare puts and their deletes before the next phase
    published, raw_puts = sum(r["acked"] for r in rounds), sum(r["acked"] for r in raw)
    span = max(r["end"] for r in rounds) - min(r["start"] for r in rounds)
    raw_span = max(r["end"] for r in raw) - min(r["start"] for r in raw)
    return {
        "nodes": nodes,
        "placements": published,
        "placements_per_s": published / span,
        "raw_puts_per_s": raw_puts / raw_span,
        "lag": _lag_figures(stamps, seen),
        "failed_txns": sum(r["failed"] for r in rounds),
        "raw_failed_txns": sum(r["failed"] for r in raw),
        "etcd_cpu_us_per_placement": etcd_cpu / max(published, 1) * 1e6,
    }


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _bare_range(endpoint: str, prefix: bytes, page_size: int) -> tuple[float, int]:
    """Seconds and key + value bytes of a paged read of ``prefix`` at one revision, in etcd's own key order (no
    sort asked: etcd 3.5 reads the whole range for every page that asks one), nothing decoded: the floor under a
    snapshot."""
    host, port = parse_endpoint(endpoint)
    client = pyetcd.client(host, port)
    start, end, revision, nbytes = prefix, prefix_end(prefix), None, 0
    t0 = time.perf_counter()
    while True:
        resp = client.get_range_response(start, end, limit=page_size, revision=revision)
        revision = revision or resp.header.revision
        nbytes += sum(len(kv.key) + len(kv.value) for kv in resp.kvs)
        if not resp.more or not resp.kvs:
            client.close()
            return time.perf_counter() - t0, nbytes
        start = resp.kvs[-1].key + b"\0"


def _client_figures(cfg: MetadataConfig, ns: Namespace) -> dict[str, Any]:
    """A new client at the final chunk count: the bare paged read, the cache's snapshot, its memory."""
    raw_s, raw_bytes = _bare_range(cfg.endpoints[0], ns.root, cfg.page_size)
    etcd = EtcdClient(cfg)
    rss0, t0 = _rss(), time.perf_counter()
    cache = MetadataCache(etcd, ns).start()
    snapshot_s, chunks = time.perf_counter() - t0, cache.chunk_count()
    gc.collect()
    rss = _rss() - rss0
    cache.close()
    del cache
    gc.collect()
    tracemalloc.start()
    cache = MetadataCache(etcd, ns).start()
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    cache.close()
    etcd.close()
    return {
        "chunks": chunks,
        "snapshot_s": snapshot_s,
        "raw_range_s": raw_s,
        "bytes_per_chunk_traced": traced / chunks,
        "bytes_per_chunk_rss": rss / chunks,
        "etcd_bytes_per_chunk": raw_bytes / chunks,
    }


def run_scale(
    s: ScaleSettings, endpoint: str, etcd_pid: int | None, db_file: Path | None, console: Console
) -> dict[str, Any]:
    """The whole simulation against the etcd at ``endpoint``; its figures as a JSON-able dict."""
    cfg = MetadataConfig(endpoints=(endpoint,), cluster=f"scale-{uuid.uuid4().hex[:8]}")
    ns, etcd, ctx = Namespace(cfg.cluster), EtcdClient(cfg), mp.get_context("spawn")
    procs, pubs, watchers = [], [], []
    for i in range(s.publisher_procs + s.watch_procs):
        mine, theirs = ctx.Pipe()
        target: Callable[..., None]
        args: tuple[Any, ...]
        if i < s.publisher_procs:
            target, args = publisher, (theirs, endpoint, cfg.cluster, s.lease_ttl_s)
            pubs.append(mine)
        else:
            j = i - s.publisher_procs
            share = (len(range(j, s.caches, s.watch_procs)), len(range(j, s.watchers, s.watch_procs)))
            target, args = watcher, (theirs, endpoint, cfg.cluster, *share)
            watchers.append(mine)
        procs.append(ctx.Process(target=target, args=args, daemon=True))
        procs[-1].start()
    out: dict[str, Any] = {
        "settings": msgspec.structs.asdict(s),
        "endpoint": endpoint,
        "cluster": cfg.cluster,
        "phases": [],
    }
    try:
        for c in watchers:
            c.recv()  # every watch started
        per_phase = s.chunks // len(s.node_counts)
        for phase, nodes in enumerate(s.node_counts):
            console.print(f"  phase {phase + 1}/{len(s.node_counts)}: {nodes} nodes publish {per_phase:,} placements")
            out["phases"].append(_phase(pubs, watchers, etcd, etcd_pid, phase, nodes, per_phase))
        console.print("  a new client's snapshot and memory")
        out["client"] = _client_figures(cfg, ns)
        out["db_bytes"] = db_file.stat().st_size if db_file and db_file.exists() else None
        revision, acked, count = _ask(pubs[:1], ("leave",))[0]
        t0 = time.monotonic()
        seen, resyncs = _collect(watchers, revision)
        out["departure"] = {
            "placements": count,
            "lag": _lag_figures([(revision, acked)], seen),
            "all_seen_s": time.monotonic() - t0,
            "resyncs": resyncs,
        }
        pubs[0].send("done")
        for c in pubs[1:] + watchers:
            c.send(("stop",))
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:  # after a failure: the children may wait for a message that will not come
            if p.is_alive():
                p.terminate()
        etcd.delete_prefix(ns.root)
        etcd.close()
    return out


# -- output ---------------------------------------------------------------------------------------------------


def _ms(lag: dict[str, dict[str, float]], kind: str) -> str:
    f = lag.get(kind)
    return f"{f['p50_ms']:.1f} / {f['p99_ms']:.1f}" if f else "-"


def render(out: dict[str, Any], console: Console) -> None:
    s, c = out["settings"], out["client"]
    table = Table(
        title=f"kvpool metadata at scale: etcd {out['endpoint']}, {s['caches']} watch caches + "
        f"{s['watchers']} bare watches, {c['chunks']:,} chunks at the end"
    )
    for col in (
        "nodes",
        "placements/s",
        "raw txn puts/s (floor)",
        "lag p50 / p99 ms, caches",
        "lag p50 / p99 ms, bare watches",
        "etcd CPU µs / placement",
    ):
        table.add_column(col, justify="right")
    for ph in out["phases"]:
        failed = f" ({ph['failed_txns']} txns failed)" if ph["failed_txns"] else ""
        raw_failed = f" ({ph['raw_failed_txns']} txns failed)" if ph["raw_failed_txns"] else ""
        table.add_row(
            str(ph["nodes"]),
            f"{ph['placements_per_s']:,.0f}{failed}",
            f"{ph['raw_puts_per_s']:,.0f}{raw_failed}",
            _ms(ph["lag"], "cache"),
            _ms(ph["lag"], "bare"),
            f"{ph['etcd_cpu_us_per_placement']:.1f}",
        )
    console.print(table)
    dep, db = out["departure"], out["db_bytes"]
    final = Table(title="a new client, and the next limits")
    for col in ("measurement", "kvpool", "floor / limit"):
        final.add_column(col, justify="left" if col == "measurement" else "right")
    final.add_row(
        f"snapshot of a new client ({c['chunks']:,} chunks)",
        f"{c['snapshot_s']:.2f} s ({c['chunks'] / c['snapshot_s']:,.0f} chunks/s)",
        f"{c['raw_range_s']:.2f} s (same pages, unsorted, not decoded)",
    )
    final.add_row(
        "client cache memory per chunk (1 replica)",
        f"{c['bytes_per_chunk_traced']:.0f} B traced · {c['bytes_per_chunk_rss']:.0f} B RSS",
        f"{c['etcd_bytes_per_chunk']:.0f} B key + value in etcd",
    )
    if db is not None:
        final.add_row(
            "etcd db file per placement (history kept 1 h)",
            f"{db / c['chunks']:.0f} B",
            f"{2 * 2**30 / db * c['chunks']:,.0f} placements fill the 2 GiB default quota",
        )
    final.add_row(
        f"a node leaves with {dep['placements']:,} placements (one revision)",
        f"lag caches {_ms(dep['lag'], 'cache')} ms · bare {_ms(dep['lag'], 'bare')} ms",
        f"watch breaks: {dep['resyncs']['cache']} caches, {dep['resyncs']['bare']} bare",
    )
    console.print(final)
    console.print(
        f"nodes: threads of {s['publisher_procs']} spawned processes (one EtcdClient each); watches: "
        f"threads of {s['watch_procs']} spawned process(es), one gRPC channel per process; "
        f"{os.cpu_count()} cores shared with etcd"
    )


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = out["phases"]
    nodes = [p["nodes"] for p in phases]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(nodes, [p["placements_per_s"] for p in phases], "o-", label="kvpool publish (PlacementStore)")
    a.plot(nodes, [p["raw_puts_per_s"] for p in phases], "s--", label="raw txn, pre-encoded (floor)")
    a.set(xscale="log", xlabel="publishing nodes", ylabel="placements / s", title="aggregate publish rate", ylim=0)
    a.legend()
    for kind, label in (("cache", "MetadataCache"), ("bare", "bare watch")):
        if any(kind in p["lag"] for p in phases):
            b.plot(nodes, [p["lag"].get(kind, {}).get("p99_ms", float("nan")) for p in phases], "o-", label=label)
    b.set(xscale="log", xlabel="publishing nodes", ylabel="ms", title="watch lag p99 (publish ack → visible)")
    b.legend()
    for ax in (a, b):
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.minorticks_off()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = ScaleSettings()
    g = ap.add_argument_group("scale simulation (--scale; full configuration: --chunks 1000000, 256 watches)")
    g.add_argument("--scale", action="store_true", help="run the simulation of many nodes and clients")
    g.add_argument("--nodes", default=",".join(map(str, d.node_counts)), help="node counts, one phase each")
    g.add_argument("--chunks", type=int, default=d.chunks, help=f"placements at the end (default {d.chunks})")
    g.add_argument("--caches", type=int, default=d.caches, help=f"real MetadataCache instances (default {d.caches})")
    g.add_argument("--watchers", type=int, default=d.watchers, help=f"bare watch streams (default {d.watchers})")
    g.add_argument("--publisher-procs", type=int, default=d.publisher_procs)
    g.add_argument("--watch-procs", type=int, default=d.watch_procs)
    g.add_argument("--json", default="bench/results/metadata_scale.json")
    g.add_argument("--png", default="bench/results/metadata_scale.png")


def main(args: argparse.Namespace, endpoint: str, etcd_pid: int | None, db_file: Path | None) -> None:
    counts = validated(_NodeCounts, args.nodes.split(","), "--nodes", strict=False)
    settings = ScaleSettings(counts, args.chunks, args.caches, args.watchers, args.publisher_procs, args.watch_procs)
    console = Console(width=160)
    out = run_scale(settings, endpoint, etcd_pid, db_file, console)
    render(out, console)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    plot(out, Path(args.png))
    console.print(f"figures written to {args.json}, plot to {args.png}")
