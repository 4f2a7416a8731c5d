"""``kvpool status``: a snapshot of a running pool, and its three renderings — a compact table that fits an
80-column terminal (the default), every column (``--wide``) and JSON (``--json``).

:func:`gather` does the I/O (the watch cache, each node's metrics endpoint); the renderers are pure functions
of a :class:`PoolStatus`, so tests build one by hand.
"""

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import typer
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table

from kvpool.cli import connect, options, root
from kvpool.cli.figures import short_duration, short_size, size
from kvpool.core.types import NodeRecord, Tier
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.identities import disagreements
from kvpool.pool.metrics import TRANSFER_FAULTS
from kvpool.pool.scrape import scrape
from kvpool.ray_auth import MODES


@dataclass(frozen=True)
class TierUse:
    held: int  #: bytes of the replicas the node holds in the tier (from the placements)
    capacity: int  #: bytes of its segments in the tier (0: no segment)


@dataclass(frozen=True)
class NodeStatus:
    node_id: str
    host: str
    pid: int
    dram: TierUse
    nvme: TierUse
    replicas: int
    up_s: float | None  #: None: the node did not say when it started
    metrics: str  #: host:port of its metrics endpoint ("": none)
    watermarks: tuple[float, float] | None  #: DRAM (low, high) fractions, from its metrics
    puts: int | None  #: None: no metrics
    gets: int | None
    moves: int | None
    lookup_hits: int  #: chunks found by prefix lookups of clients on this node
    lookups: int  #: chunks those lookups asked for
    #: tenant -> tier -> (bytes its chunks take, its quota; 0: none), from the node's metrics
    tenants: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    ray_auth: str = ""  #: the authentication its Ray node runs with (token / disabled), from its metrics; "": unknown
    #: transfers of its clients with peers that went wrong, by kind (kvpool_transfer_faults_total{kind}), from its
    #: metrics: kinds that happened only
    faults: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RemoteTier:
    chunks: int
    stored: int  #: stored bytes (after the codec)
    chunk_bytes: int  #: bytes of KV they hold
    codecs: tuple[str, ...]


@dataclass(frozen=True)
class IdentityStatus:
    """A cache identity a client registered (``PoolClient.register_identity``)."""

    fingerprint: str
    model: str
    kv_dtype: str
    layout: str
    chunk_size: int
    tp: str  #: "rank/size"
    codec: str
    host: str  #: who registered it last
    age_s: float  #: since then


@dataclass(frozen=True)
class PoolStatus:
    cluster: str
    endpoints: tuple[str, ...]
    revision: int
    nodes: tuple[NodeStatus, ...]
    chunks: int
    replicas: int
    malformed: int  #: records the cache skipped because it could not decode them
    remote: RemoteTier
    identities: tuple[IdentityStatus, ...] = ()
    warnings: tuple[str, ...] = ()  #: identities of one model that differ: their chunks never match


def gather(cache: MetadataCache, read_metrics: Callable[[str], dict[str, float]] = scrape) -> PoolStatus:
    """A snapshot of the pool ``cache`` watches, with each node's metrics read by ``read_metrics``."""
    now = time.time()
    nodes = tuple(_node(cache, n, read_metrics(n.metrics) if n.metrics else {}, now) for n in cache.nodes())
    remote = [p for _, replicas in cache.chunks() for p in replicas if p.tier is Tier.REMOTE]
    registered = cache.identities()
    identities = tuple(
        IdentityStatus(
            f,
            r.identity.model,
            r.identity.kv_dtype,
            r.identity.layout,
            r.identity.chunk_size,
            f"{r.identity.tp_rank}/{r.identity.tp_size}",
            r.identity.codec,
            r.host,
            now - r.at,
        )
        for f, r in sorted(registered.items(), key=lambda i: (i[1].identity.model, i[0]))
    )
    return PoolStatus(
        cluster=cache.namespace.cluster,
        endpoints=tuple(cache.etcd.config.endpoints),
        revision=cache.revision,
        nodes=nodes,
        chunks=cache.chunk_count(),
        replicas=cache.replica_count(),
        malformed=cache.malformed,
        remote=RemoteTier(
            len(remote),
            sum(p.stored for p in remote),
            sum(p.size for p in remote),
            tuple(sorted({p.codec for p in remote})),
        ),
        identities=identities,
        warnings=tuple(disagreements(registered.values())),
    )


def _node(cache: MetadataCache, n: NodeRecord, m: dict[str, float], now: float) -> NodeStatus:
    def count(name: str) -> int | None:
        return int(m[name]) if name in m else None

    low, high = "kvpool_dram_watermark_ratio{low}", "kvpool_dram_watermark_ratio{high}"
    hits, misses = (int(m.get(f"kvpool_lookup_chunks_total{{{r}}}", 0.0)) for r in ("hit", "miss"))
    tenants: dict[str, dict[str, tuple[int, int]]] = {}
    for name, value in m.items():
        metric, _, labels = name.partition("{")
        if metric in ("kvpool_tenant_used_bytes", "kvpool_tenant_quota_bytes"):
            tenant, tier = labels.rstrip("}").split(",")
            used, quota = tenants.setdefault(tenant, {}).get(tier, (0, 0))
            is_used = metric == "kvpool_tenant_used_bytes"
            tenants[tenant][tier] = (int(value), quota) if is_used else (used, int(value))
    return NodeStatus(
        node_id=n.node_id,
        host=n.host,
        pid=n.pid,
        dram=TierUse(cache.bytes_held(n.node_id, Tier.DRAM), n.capacity(Tier.DRAM)),
        nvme=TierUse(cache.bytes_held(n.node_id, Tier.NVME), n.capacity(Tier.NVME)),
        replicas=cache.replica_count(n.node_id),
        up_s=now - n.started if n.started else None,
        metrics=n.metrics,
        watermarks=(m[low], m[high]) if low in m and high in m else None,
        puts=count("kvpool_puts_total"),
        gets=count("kvpool_gets_total"),
        moves=count("kvpool_tier_moves_total"),
        lookup_hits=hits,
        lookups=hits + misses,
        tenants=tenants,
        ray_auth=next((mode for mode in MODES if m.get(f"kvpool_ray_auth_mode{{{mode}}}")), ""),
        faults={k: int(c) for k in TRANSFER_FAULTS if (c := m.get(f"kvpool_transfer_faults_total{{{k}}}"))},
    )


def _title(s: PoolStatus) -> str:
    return f"kvpool cluster '{s.cluster}' — etcd {', '.join(s.endpoints)}, revision {s.revision}"


def _hit_rate(n: NodeStatus, wide: bool) -> str:
    if not n.lookups:
        return "-"
    rate = f"{n.lookup_hits / n.lookups:.0%}"
    return f"{rate} of {n.lookups}" if wide else rate


def compact_table(s: PoolStatus) -> Table:
    """Seven columns that fit 80: node (id prefix), host, DRAM and NVMe held/capacity, replicas, hit rate, up."""
    table = Table(title=_title(s), box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("node", "host", "DRAM", "NVMe", "replicas", "hit rate", "up"):
        if col == "host":  # the one column of any length: it folds, the others keep their cells whole
            table.add_column(col, overflow="fold")
        else:
            table.add_column(col, justify="left" if col == "node" else "right", no_wrap=True, min_width=len(col))
    for n in s.nodes:
        tiers = [f"{short_size(t.held)}/{short_size(t.capacity)}" if t.capacity else "-" for t in (n.dram, n.nvme)]
        up = short_duration(n.up_s) if n.up_s is not None else "?"
        table.add_row(n.node_id[:8], n.host, *tiers, str(n.replicas), _hit_rate(n, wide=False), up)
    if not s.nodes:
        table.add_row("(no live nodes)")
    return table


WIDE_COLUMNS = (
    "node",
    "host",
    "pid",
    "DRAM held / capacity",
    "NVMe held / capacity",
    "watermarks",
    "replicas",
    "puts",
    "gets",
    "moves",
    "hit rate",
    "up for",
    "metrics",
)


def wide_table(s: PoolStatus) -> Table:
    """Every column: the compact ones in full, plus pid, DRAM watermarks, traffic counters and metrics endpoint."""
    table = Table(title=_title(s))
    for col in WIDE_COLUMNS:
        table.add_column(col, justify="left" if col in ("node", "host", "metrics") else "right")
    for n in s.nodes:
        tiers = [f"{size(t.held)} / {size(t.capacity)}" if t.capacity else "no segment" for t in (n.dram, n.nvme)]
        marks = f"{n.watermarks[0]:.0%}-{n.watermarks[1]:.0%}" if n.watermarks else "-"
        counts = ["-" if c is None else str(c) for c in (n.puts, n.gets, n.moves)]
        up = f"{n.up_s:.0f} s" if n.up_s is not None else "?"
        table.add_row(
            n.node_id[:12],
            n.host,
            str(n.pid),
            *tiers,
            marks,
            str(n.replicas),
            *counts,
            _hit_rate(n, wide=True),
            up,
            n.metrics,
        )
    if not s.nodes:
        table.add_row("(no live nodes)")
    return table


def footer(s: PoolStatus) -> str:
    """Chunks, replicas and malformed records; the remote tier's chunks when it holds any."""
    r = s.remote
    remote = (
        f"\nremote tier: {r.chunks} chunks, {size(r.stored)} stored ({size(r.chunk_bytes)} of KV; {', '.join(r.codecs)})"
        if r.chunks
        else ""
    )
    return f"chunks: {s.chunks}   replicas: {s.replicas}   malformed records skipped: {s.malformed}{remote}"


def identities_table(s: PoolStatus) -> Table:
    """The cache identities clients registered: fingerprint, model and what else makes keys differ."""
    table = Table(title="cache identities in use", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("fingerprint", "model", "kv dtype", "layout", "chunk", "tp", "codec", "registered by", "ago"):
        table.add_column(col, overflow="fold")
    for i in s.identities:
        table.add_row(
            i.fingerprint,
            i.model,
            i.kv_dtype,
            i.layout,
            str(i.chunk_size),
            i.tp,
            i.codec,
            i.host,
            short_duration(i.age_s),
        )
    return table


def tenant_table(s: PoolStatus, tenant: str) -> Table:
    """What ``tenant`` holds on each live node against its quota there (pool/tenants.py)."""
    table = Table(title=f"tenant '{tenant}' — {_title(s)}", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("node", "host", "DRAM used / quota", "NVMe used / quota"):
        table.add_column(col, justify="left" if col in ("node", "host") else "right")
    for n in s.nodes:
        tiers = n.tenants.get(tenant, {})
        cells = []
        for tier in (Tier.DRAM.value, Tier.NVME.value):
            used, quota = tiers.get(tier, (0, 0))
            cells.append(f"{size(used)} / {size(quota) if quota else 'no quota'}")
        table.add_row(n.node_id[:12], n.host, *cells)
    return table


def ray_auth_line(s: PoolStatus) -> str:
    """Which authentication the nodes' Ray runs with; nodes without it named in a warning."""
    open_nodes = [n.host for n in s.nodes if n.ray_auth == "disabled"]
    if open_nodes:
        return (
            f"warning: Ray authentication is DISABLED on {', '.join(open_nodes)}: anyone who reaches those Ray ports "
            "can run code there and read every chunk (docs/security.md)"
        )
    modes = {n.ray_auth or "unknown (no metrics)" for n in s.nodes}
    return f"ray authentication: {', '.join(sorted(modes))}"


def faults_line(s: PoolStatus) -> str:
    """The nodes whose clients' transfers with peers went wrong, and how ("": none did)."""
    said = [f"{n.node_id[:8]} {', '.join(f'{c} {k}' for k, c in n.faults.items())}" for n in s.nodes if n.faults]
    return f"transfer faults (kvpool_transfer_faults_total): {'; '.join(said)}" if said else ""


def warnings(s: PoolStatus) -> str:
    return "\n".join(f"warning: {w}" for w in s.warnings)


def render(s: PoolStatus, wide: bool = False) -> RenderableType:
    """The table (compact, or every column with ``wide``), the footer, the nodes' Ray authentication, the identities
    in use (a count; listed with ``wide``) and any warning about them."""
    parts: list[RenderableType] = [wide_table(s) if wide else compact_table(s), footer(s)]
    if s.nodes:
        parts.append(ray_auth_line(s))
    if faults := faults_line(s):
        parts.append(faults)
    if s.identities:
        parts.append(
            identities_table(s) if wide else f"cache identities in use: {len(s.identities)} (--wide lists them)"
        )
    if s.warnings:
        parts.append(warnings(s))
    return Group(*parts)


def to_json(s: PoolStatus) -> str:
    return json.dumps(asdict(s), indent=2)


@root.app.command()
def status(
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
    wide: bool = typer.Option(
        False, "--wide", help="Every column: pid, watermarks, puts/gets/moves, lookups, metrics endpoint."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the snapshot as JSON, for scripts."),
    tenant: str = typer.Option(
        "", "--tenant", help="Show what this tenant (of the tenants file) holds on each node against its quota."
    ),
) -> None:
    """Show a running pool: live nodes, their tiers (held / capacity) and the chunks they hold.

    The default table fits 80 columns.  --wide adds each node's pid, DRAM watermarks, traffic counters,
    the hit rate of its clients' prefix lookups (scraped from its metrics endpoint); --json prints it all.
    """
    with root.errors(), connect.running_cache(etcd, cluster, "status") as cache:
        snapshot = gather(cache)
    if as_json:
        typer.echo(to_json(snapshot))
    elif tenant:
        root.console.print(tenant_table(snapshot, tenant))
        if not any(tenant in n.tenants for n in snapshot.nodes):
            root.console.print(f"tenant '{tenant}' holds nothing on the live nodes (and none of them has its quota)")
    else:
        root.console.print(render(snapshot, wide))
