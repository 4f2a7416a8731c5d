"""The multi-node benchmark behind ``kvpool bench`` (the command line lives in kvpool/cli/bench.py, the layer above).

It runs on whatever pool it is given — the embedded default (a local Ray cluster on loopback) or a real
cluster started with ``ray up cluster.yaml`` — and measures, with one ``PoolClient`` actor pinned to each
node:

* **matrix**: get (and put) throughput from every node to every node, per tier (DRAM, NVMe): the chunks
  live on the *holder*, a client on the *reader* fetches them (same node: a local copy; across nodes: a
  one-sided NIXL/UCX READ);
* **scaling**: aggregate get throughput as 1, 2, … N nodes read at once, each from its neighbour;
* **TTFT**: cold (recompute) and warm (reload) time to first token of a prefill worker on the first node
  and a decode worker on the last.

Beside the figures it prints this machine's own limits measured in the same run: single-thread memcpy, a
loopback TCP socket, and raw O_DIRECT disk I/O.  Results go to a JSON file and PNG plots.
"""

import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray

from kvpool.bench.limits import gbps, measure_limits
from kvpool.bench.node_client import close_clients, node_clients
from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.pool.config import MiB, PoolConfig

TIERS = (Tier.DRAM, Tier.NVME)

# -- the benchmark ---------------------------------------------------------------------------------------


@dataclass
class Settings:
    size: int = 4 * MiB  #: bytes per chunk
    per_cell: int = 64 * MiB  #: bytes moved per measurement
    repeat: int = 3
    tiers: tuple[Tier, ...] = TIERS
    ttft_tokens: tuple[int, ...] = (1024, 4096)
    ttft_model: str = "tiny-llama"


@dataclass
class Results:
    nodes: list[str]  #: node ids, in the order of every matrix
    hosts: list[str]
    settings: dict[str, Any]
    limits: dict[str, float]
    put: list[list[float]] = field(default_factory=list)  #: put[writer][holder], GB/s
    get: dict[str, list[list[float]]] = field(default_factory=dict)  #: get[tier][holder][reader], GB/s
    scaling: list[dict[str, float]] = field(default_factory=list)
    ttft: list[dict[str, float]] = field(default_factory=list)


def _keys(tag: str, n: int) -> list[bytes]:
    ident = CacheIdentity(model=f"kvpool-bench-{tag}", kv_dtype="uint8", layout="bytes", chunk_size=1)
    return chunk_keys(ident, np.arange(n))


def run(
    config: PoolConfig,
    settings: Settings,
    progress: Callable[[str, int], None] = lambda what, steps: None,
    disk_dir: str | None = None,
) -> Results:
    """Every measurement on the pool of ``config`` (attached: ``ray.init`` done, PoolNodes running).

    ``progress(what, steps)`` is called before each measurement with how many steps it adds."""
    alive = sorted((n["NodeManagerAddress"], n["NodeID"]) for n in ray.nodes() if n["Alive"])
    hosts, ids = [h for h, _ in alive], [i for _, i in alive]
    n = max(1, settings.per_cell // settings.size)
    progress("limits", 1)
    results = Results(
        ids,
        hosts,
        {**asdict(settings), "tiers": [t.value for t in settings.tiers], "chunks_per_cell": n},
        asdict(measure_limits(disk_dir)),
    )
    clients = node_clients(config, ids)
    try:
        _warm_up(clients, ids)
        results.put = _put_matrix(clients, ids, hosts, settings, n, progress)
        for tier in settings.tiers:
            results.get[tier.value] = _get_matrix(clients, ids, hosts, settings, n, tier, progress)
        results.scaling = _scaling(clients, ids, hosts, settings, n, progress)
    finally:
        close_clients(clients)
    if settings.ttft_tokens:
        results.ttft = _ttft(config, ids, settings, progress)
    return results


def _warm_up(clients: list[Any], ids: list[str]) -> None:
    """Every client connects to every node once (NIXL peers, registrations) before anything is timed."""
    warm = [_keys(f"warm-{w}-{uuid.uuid4().hex[:8]}", len(ids)) for w in range(len(ids))]
    ray.get(
        [
            c.put.remote([k], 4096, holder)
            for c, ks in zip(clients, warm, strict=True)
            for k, holder in zip(ks, ids, strict=True)
        ]
    )
    ray.get([c.remove.remote(ks) for c, ks in zip(clients, warm, strict=True)])


def _put_matrix(
    clients: list[Any],
    ids: list[str],
    hosts: list[str],
    settings: Settings,
    n: int,
    progress: Callable[[str, int], None],
) -> list[list[float]]:
    """put[writer][holder], GB/s: ``n`` chunks written by each client into each node's DRAM."""
    grid = []
    for w, writer in enumerate(clients):
        row = []
        for h, holder in enumerate(ids):
            progress(f"put {hosts[w]} → {hosts[h]}", 1)
            keys = _keys(f"put-{w}-{h}-{uuid.uuid4().hex[:8]}", n)
            elapsed = ray.get(writer.put.remote(keys, settings.size, holder))
            row.append(gbps(n * settings.size, elapsed.wall_s))
            ray.get(writer.remove.remote(keys))
        grid.append(row)
    return grid


def _get_matrix(
    clients: list[Any],
    ids: list[str],
    hosts: list[str],
    settings: Settings,
    n: int,
    tier: Tier,
    progress: Callable[[str, int], None],
) -> list[list[float]]:
    """get[holder][reader], GB/s: ``n`` chunks held by each node (moved to ``tier``), read by each client."""
    grid = []
    move = tier.value if tier is not Tier.DRAM else ""
    for h, holder in enumerate(ids):
        keys = _keys(f"get-{h}-{uuid.uuid4().hex[:8]}", n)
        ray.get(clients[h].put.remote(keys, settings.size, holder))
        row = []
        for r, reader in enumerate(clients):
            progress(f"get {tier.value} {hosts[h]} → {hosts[r]}", 1)
            seconds = ray.get(reader.get.remote(keys, settings.size, move, settings.repeat))
            row.append(gbps(n * settings.size, seconds))
        ray.get(clients[h].remove.remote(keys))
        grid.append(row)
    return grid


def _scaling(
    clients: list[Any],
    ids: list[str],
    hosts: list[str],
    settings: Settings,
    n: int,
    progress: Callable[[str, int], None],
) -> list[dict[str, float]]:
    """Aggregate DRAM get GB/s with k = 1..N readers at once, reader i reading chunks held by node i+1."""
    k_max = len(ids)
    keys = [_keys(f"scale-{i}-{uuid.uuid4().hex[:8]}", n) for i in range(k_max)]
    ray.get([clients[i].put.remote(keys[i], settings.size, ids[i]) for i in range(k_max)])
    out = []
    try:
        for k in range(1, k_max + 1):
            progress(f"scaling: {k} reader(s)", 1)
            t0 = time.perf_counter()
            seconds = ray.get([clients[i].get.remote(keys[(i + 1) % k_max], settings.size, "", 1) for i in range(k)])
            wall = time.perf_counter() - t0
            out.append(
                {
                    "readers": k,
                    "aggregate_gbps": gbps(k * n * settings.size, wall),
                    "per_reader_gbps": statistics.mean(gbps(n * settings.size, s) for s in seconds),
                    "cross_node": float(k_max > 1),
                }
            )
    finally:
        ray.get([clients[i].remove.remote(keys[i]) for i in range(k_max)])
    return out


def _ttft(
    config: PoolConfig, ids: list[str], settings: Settings, progress: Callable[[str, int], None]
) -> list[dict[str, float]]:
    """Cold and warm TTFT of one prompt per length, through a prefill worker (first node) and a decode worker
    (last node): cold computes the prompt, warm reloads its KV from the pool."""
    from kvpool.prefill_decode.reference.service import Lane, Service
    from kvpool.prefill_decode.reference.workers import WorkerConfig, start_workers

    progress(f"TTFT: starting {settings.ttft_model} workers", 1)
    prefill, decode = start_workers(
        WorkerConfig(pool=config, model=settings.ttft_model, torch_threads=os.cpu_count() or 1), ids[0], ids[-1]
    )
    service = Service(Lane(prefill, decode), model=settings.ttft_model)
    out = []
    try:
        for tokens in settings.ttft_tokens:
            progress(f"TTFT: {tokens} tokens cold and warm", 1)
            prompt = [(uuid.uuid4().int + i * 7919) % 500 for i in range(tokens)]
            cold = service.complete_sync(prompt, 1)
            warm = service.complete_sync(prompt, 1)
            out.append(
                {
                    "tokens": tokens,
                    "cold_s": cold.ttft_s,
                    "warm_s": warm.ttft_s,
                    "speedup": cold.ttft_s / warm.ttft_s,
                    "reused_tokens": warm.prefill.summary.reused_tokens,
                    "same_token": float(cold.tokens == warm.tokens),
                }
            )
    finally:
        for h in (prefill, decode):
            ray.kill(h)
    return out


def steps(n_nodes: int, settings: Settings) -> int:
    """How many progress steps :func:`run` reports for ``n_nodes`` nodes."""
    ttft = 1 + len(settings.ttft_tokens) if settings.ttft_tokens else 0
    return 1 + n_nodes * n_nodes * (1 + len(settings.tiers)) + n_nodes + ttft


# -- output -----------------------------------------------------------------------------------------------


def plot(results: Results, path: Path) -> Path:
    """One PNG: the get matrix per tier (heat maps), put matrix, scaling and TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = [("put, writer → holder", results.put)] + [(f"get {t}, holder → reader", g) for t, g in results.get.items()]
    panels = len(grids) + 1 + bool(results.ttft)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 4))
    labels = results.hosts
    top = max(max(max(r) for r in g) for _, g in grids)
    for ax, (title, grid) in zip(axes, grids, strict=False):
        im = ax.imshow(np.array(grid), cmap="viridis", vmin=0, vmax=top)
        ax.set_title(f"{title}\nGB/s")
        ax.set_xticks(range(len(labels)), labels, rotation=45, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        for (i, j), v in np.ndenumerate(np.array(grid)):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
    fig.colorbar(im, ax=axes[: len(grids)], shrink=0.8)
    ax = axes[len(grids)]
    ks = [s["readers"] for s in results.scaling]
    ax.plot(ks, [s["aggregate_gbps"] for s in results.scaling], "o-", label="aggregate get")
    ax.plot(ks, [s["per_reader_gbps"] for s in results.scaling], "s--", label="per reader")
    ax.axhline(results.limits["memcpy"], color="grey", ls=":", label="memcpy (1 thread)")
    ax.axhline(results.limits["socket"], color="grey", ls="-.", label="TCP loopback")
    ax.set(title="scaling: nodes reading at once", xlabel="readers", ylabel="GB/s", xticks=ks)
    ax.legend(fontsize=7)
    if results.ttft:
        ax = axes[-1]
        x = np.arange(len(results.ttft))
        ax.bar(x - 0.2, [t["cold_s"] for t in results.ttft], 0.4, label="cold (recompute)")
        ax.bar(x + 0.2, [t["warm_s"] for t in results.ttft], 0.4, label="warm (reload)")
        ax.set_xticks(x, [f"{t['tokens']} tok" for t in results.ttft])
        ax.set(title=f"TTFT, {results.settings['ttft_model']}", ylabel="s", yscale="log")
        ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
