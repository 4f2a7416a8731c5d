"""What a fleet costs as it grows: the trace served by 16, 128 and 1,024 simulated nodes (the trace's traffic times
nodes / 16: that many independent copies of it, each under its own cache identity, interleaved on the trace's clock),
and what their placements ask of one etcd and their reads of each link.

etcd's side is priced from the pool's own record encoders (``metadata/records.py``, ``metadata/namespace.py``: the
bytes of a placement's key and value, of a tombstone's) and set beside what ``bench/metadata.py --scale`` measured of
one etcd on this machine (:data:`MEASURED`, from docs/operations.md "Metadata at scale", 2026-12-02): every client's
watch cache receives every placement event of the cluster, so the events etcd sends grow as nodes x placements/s.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvpool.bench.fleet_sim import NIC_BYTES_S, FleetResult, FleetSettings
from kvpool.bench.workloads.mooncake import Request, load
from kvpool.core.keys import KEY_BYTES
from kvpool.core.types import DropCause, Placement, Tier, Tombstone
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.records import encode_placement, encode_tombstone
from kvpool.metadata.tombstones import TTL_S


#: one etcd as ``bench/metadata.py --scale`` measured it (docs/operations.md, "Metadata at scale"; 2 shared cores,
#: embedded etcd 3.5.1 without fsync, one run each, runs vary +-30 %)
@dataclass(frozen=True)
class Measured:
    placements_s_64_watches: tuple[float, float] = (3_339, 5_837)
    placements_s_256_watches: tuple[float, float] = (1_500, 2_100)
    etcd_us_per_event_per_watch: tuple[float, float] = (0.8, 2.0)
    cache_bytes_per_chunk: int = 676  #: a client's watch cache, one replica a chunk (tracemalloc)
    db_bytes_per_placement: int = 690  #: etcd's db file, 1 h of history
    quota_bytes: int = 2 * 2**30  #: etcd's default backend quota


MEASURED = Measured()


class Replayer(Protocol):
    def replay(
        self, what: str, requests: Sequence[Request], settings: FleetSettings, logs: Sequence[Any] = ()
    ) -> FleetResult: ...


def record_bytes(cluster: str = "default", node_id: str = "node-0000") -> dict[str, int]:
    """etcd bytes a publish writes per change, by the pool's encoders: a placement (put: key + value), a drop (the
    placement's delete: its key; the tombstone's put: key + value)."""
    ns, key = Namespace(cluster), bytes(range(KEY_BYTES))
    p = Placement(key, node_id, Tier.NVME, 123 << 28, 160 << 20, 160 << 20, 2**31, "raw", "f" * 16)
    t = Tombstone(key, node_id, DropCause.EVICTED, Tier.NVME, 1.7e9, "lru")
    placement = len(ns.replica(key, node_id)) + len(encode_placement(p))
    tombstone = len(ns.tombstone(key, node_id)) + len(encode_tombstone(t))
    return {"placement": placement, "drop": len(ns.replica(key, node_id)) + tombstone, "tombstone": tombstone}


def cost_row(nodes: int, r: FleetResult) -> dict[str, Any]:
    """One fleet size's figures from its replay ``r``."""
    sizes, span = record_bytes(), r.span_s
    pub = r.published
    puts = pub["added"] + pub["moved"] + pub["s3"]
    changes_s = (puts + pub["dropped"]) / span
    events_s = (puts + 2 * pub["dropped"]) / span  # a drop: the placement's delete and its tombstone's put
    fanout = events_s * nodes  # one watching client a node
    lo, hi = MEASURED.etcd_us_per_event_per_watch
    tombstones = min(pub["dropped"] / span * TTL_S, pub["dropped"])
    store = r.held_chunks * sizes["placement"] + tombstones * sizes["tombstone"]
    links = {k: v / span / nodes for k, v in r.links.items()}
    return {
        "nodes": nodes,
        "requests_s": r.requests / span,
        "hit_rate": r.hit_rate,
        "placements_s": changes_s,
        "watch_events_per_client_s": events_s,
        "etcd_cpu_cores": (fanout * lo / 1e6, fanout * hi / 1e6),
        "etcd_write_bytes_s": (puts * sizes["placement"] + pub["dropped"] * sizes["drop"]) / span,
        "store_bytes": store,
        "store_db_bytes": (r.held_chunks + tombstones) * MEASURED.db_bytes_per_placement,
        "client_cache_bytes": r.held_chunks * MEASURED.cache_bytes_per_chunk,
        "link_bytes_s_per_node": links,
        "peer_out_max_bytes_s": max(r.peer_out.values(), default=0) / span,
        "nic_bytes_s": NIC_BYTES_S,
    }


def cost_rows(
    run: Replayer, name: str, base: FleetSettings, fleet_sizes: Sequence[int], span_s: float
) -> list[dict[str, Any]]:
    """The trace's first ``span_s`` seconds on each fleet size, ``nodes / base.nodes`` copies of its traffic, on the
    full tiering (DRAM, NVMe 4x DRAM, S3)."""
    rows = []
    for nodes in fleet_sizes:
        copies = max(1, nodes // base.nodes)
        requests = load(name, span_s=span_s, copies=copies)
        settings = replace(base, nodes=nodes, nvme_tokens=base.nvme_tokens or 4 * base.dram_tokens, s3=True)
        r = run.replay(f"{name}: {nodes} nodes, {copies} copies", requests, settings)
        rows.append(cost_row(nodes, r))
    return rows
