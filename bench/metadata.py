"""Metadata micro-benchmark: records encoded and decoded per second, placements published per second, and
longest-prefix lookup latency.

Runs against a real etcd (embedded by default, or --etcd host:port) and prints each figure beside the
floor it cannot beat on this machine: raw etcd transactions of the same size without kvpool's
encoding, a loopback TCP round trip, and plain dict lookups.  --codec-only measures the
record codec alone, without etcd.  --scale runs the simulation of many nodes publishing and many clients
watching against that one etcd instead (``bench/metadata_scale.py``: publish rate, watch lag, a client's memory
per chunk and snapshot time, by node count; table, JSON and PNG under bench/results/).

    python bench/metadata.py [--placements 10000] [--lookups 2000] [--etcd host:port] [--codec-only]
    python bench/metadata.py --scale [--nodes 1,4,16,64] [--chunks 100000] [--caches 4] [--watchers 60]
"""

import argparse
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
from rich.console import Console
from rich.table import Table

from kvpool.bench import metadata_scale
from kvpool.bench.metadata_sim import node_record
from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Placement, Tier
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient, Get, Put, prefix_end
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore, batches
from kvpool.metadata.records import decode_node, decode_placement, encode_node, encode_placement
from kvpool.servers.etcd import EmbeddedEtcd

PREFIX_CHUNKS = 128
CODEC_RECORDS = 20_000  #: records per codec round; the best of CODEC_ROUNDS rounds is reported
CODEC_ROUNDS = 5
Row = tuple[str, str, str]  #: measurement, kvpool's figure, the floor beside it


def placements(keys: list[bytes]) -> list[Placement]:
    return [
        Placement(key=k, node="bench-node", tier=Tier.DRAM, offset=i << 20, stored=1 << 20, size=1 << 20, checksum=i)
        for i, k in enumerate(keys)
    ]


def percentiles(samples: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(samples, n=100)
    return statistics.median(samples), q[98]


def per_second(fn: Callable[[Any], object], items: Sequence[Any]) -> float:
    """Items ``fn`` handles per second, ``fn`` mapped over ``items`` (best of CODEC_ROUNDS rounds)."""
    best = float("inf")
    for _ in range(CODEC_ROUNDS):
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, time.perf_counter() - t0)
    return len(items) / best


def codec_row(
    what: str, records: Sequence[Any], encode: Callable[[Any], bytes], decode: Callable[[bytes], object]
) -> Row:
    """Encode and decode rates of ``records``, beside msgpack's bare round trip of the same maps (no types, no
    checks)."""
    raw = [encode(r) for r in records]
    maps = [msgpack.unpackb(r) for r in raw]
    enc, dec = per_second(encode, records), per_second(decode, raw)
    floor = f"{per_second(msgpack.packb, maps):,.0f} / {per_second(msgpack.unpackb, raw):,.0f} per s (bare msgpack)"
    return f"{what} encode / decode ({len(raw[0])} B)", f"{enc:,.0f} / {dec:,.0f} per s", floor


def codec_rows() -> list[Row]:
    keys = [i.to_bytes(32, "big") for i in range(CODEC_RECORDS)]
    return [
        codec_row("placement", placements(keys), encode_placement, lambda r: decode_placement(keys[0], "n", r)),
        codec_row("node record", [node_record()] * CODEC_RECORDS, encode_node, lambda r: decode_node("n", r)),
    ]


def tcp_round_trip_us(n: int = 2000) -> float:
    """Median loopback TCP ping-pong of 64 bytes: the floor under any etcd round trip."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(64):
                conn.sendall(data)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    samples = []
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            t0 = time.perf_counter()
            c.sendall(b"x" * 64)
            got = 0
            while got < 64:
                got += len(c.recv(64 - got))
            samples.append(time.perf_counter() - t0)
    server.close()
    return statistics.median(samples) * 1e6


def timed(samples: list[float], fn: Callable[[], object], n: int) -> list[float]:
    """``samples`` extended with the seconds of ``n`` calls of ``fn``."""
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def publish_rows(etcd: EtcdClient, ns: Namespace, keys: list[bytes]) -> list[Row]:
    """Placements published per second beside raw transactions of the same puts (already encoded)."""
    store, items, lease = PlacementStore(etcd, ns), placements(keys), etcd.grant_lease(60)
    t0 = time.perf_counter()
    store.publish(items, lease)
    publish_s = time.perf_counter() - t0
    raw = [(ns.root + b"raw/" + p.key.hex().encode(), encode_placement(p)) for p in items]
    t0 = time.perf_counter()
    for batch in batches(raw, etcd.config.txn_max_ops):
        etcd.txn([], [Put(k, v, lease) for k, v in batch])
    raw_s = time.perf_counter() - t0
    n, ops = len(items), etcd.config.txn_max_ops
    return [
        (f"publish, {ops}/txn", f"{n / publish_s:,.0f} placements/s", f"{n / raw_s:,.0f} puts/s (raw txn, pre-encoded)")
    ]


def lookup_rows(etcd: EtcdClient, ns: Namespace, keys: list[bytes], lookups: int) -> list[Row]:
    """Longest-prefix lookups asked of etcd (one range read per chunk, in one txn) and of the watch cache."""
    prefix = keys[:PREFIX_CHUNKS]
    ranges = [Get(ns.chunk(k), prefix_end(ns.chunk(k))) for k in prefix]
    direct = timed([], lambda: etcd.txn([], ranges), max(1, lookups // 10))
    single = timed([], lambda: etcd.get(ns.replica(prefix[0], "bench-node")), max(1, lookups // 10))
    t0 = time.perf_counter()
    with MetadataCache(etcd, ns) as cache:
        snapshot_s = time.perf_counter() - t0
        assert cache.lookup_prefix(prefix) == PREFIX_CHUNKS
        cached = timed([], lambda: cache.lookup_prefix(prefix), lookups)
    as_dict = dict.fromkeys(keys, True)
    plain = timed([], lambda: sum(1 for k in prefix if k in as_dict), lookups)
    (d50, d99), (g50, _), (c50, c99), (p50, _) = map(percentiles, (direct, single, cached, plain))
    return [
        (
            f"lookup_prefix({PREFIX_CHUNKS}) via etcd (1 txn)",
            f"p50 {d50 * 1e3:.2f} ms · p99 {d99 * 1e3:.2f} ms",
            f"single get {g50 * 1e3:.2f} ms · TCP RTT {tcp_round_trip_us():.0f} µs",
        ),
        (
            f"lookup_prefix({PREFIX_CHUNKS}) via watch cache",
            f"p50 {c50 * 1e6:.1f} µs · p99 {c99 * 1e6:.1f} µs",
            f"{PREFIX_CHUNKS} dict lookups {p50 * 1e6:.1f} µs",
        ),
        (f"cache start (paged snapshot of {2 * len(keys)} keys)", f"{snapshot_s * 1e3:.0f} ms", ""),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--placements", type=int, default=10_000, help="placements to publish (default 10000)")
    ap.add_argument("--lookups", type=int, default=2_000, help="prefix lookups to time (default 2000)")
    ap.add_argument("--etcd", help="host:port of an etcd to use instead of an embedded one")
    ap.add_argument("--codec-only", action="store_true", help="only the record encode/decode rates (no etcd)")
    metadata_scale.add_arguments(ap)
    args = ap.parse_args()
    if args.scale:
        server = None if args.etcd else EmbeddedEtcd().start()
        try:
            db_file = None if server is None else server.data_dir / "member" / "snap" / "db"
            pid = None if server is None else server.pid
            metadata_scale.main(args, args.etcd or server.endpoint, pid, db_file)  # type: ignore[union-attr]
        finally:
            if server is not None:
                server.stop()
        return
    rows = codec_rows()
    title = f"kvpool record codec ({CODEC_RECORDS} records, best of {CODEC_ROUNDS})"
    if not args.codec_only:
        server = None if args.etcd else EmbeddedEtcd().start()
        endpoint = args.etcd or server.endpoint  # type: ignore[union-attr]
        cfg = MetadataConfig(endpoints=(endpoint,), cluster=f"bench-{uuid.uuid4().hex[:8]}")
        etcd, ns = EtcdClient(cfg), Namespace(cfg.cluster)
        keys = chunk_keys(
            CacheIdentity(model="bench", kv_dtype="bf16", layout="all", chunk_size=16), range(16 * args.placements)
        )
        try:
            rows += publish_rows(etcd, ns, keys) + lookup_rows(etcd, ns, keys, args.lookups)
        finally:
            etcd.delete_prefix(ns.root)
            etcd.close()
            if server is not None:
                server.stop()
        title = f"kvpool metadata on etcd {endpoint} ({len(keys)} placements, {PREFIX_CHUNKS}-chunk prefix)"
    table = Table(title=title)
    for col in ("measurement", "kvpool", "floor on this machine"):
        table.add_column(col, justify="left" if col == "measurement" else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


if __name__ == "__main__":
    main()
