"""Metadata micro-benchmark: placements published per second, and longest-prefix lookup latency.

Runs against a real etcd (embedded by default, or --etcd host:port) and prints each figure beside the
floor it cannot beat on this machine: raw etcd transactions of the same size without kvpool's
create-if-absent compares, a loopback TCP round trip, and plain dict lookups.

    python bench/metadata.py [--placements 10000] [--lookups 2000] [--etcd host:port]
"""

import argparse
import socket
import statistics
import threading
import time
import uuid

from rich.console import Console
from rich.table import Table

from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient, Put
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.metadata.placement import PlacementStore, batches
from kvpool.metadata.records import Placement, Tier
from kvpool.pool.keys import CacheIdentity, chunk_keys
from kvpool.servers.etcd import EmbeddedEtcd

PREFIX_CHUNKS = 128


def placements(keys: list[bytes]) -> list[Placement]:
    now = time.time()
    return [
        Placement(key=k, node="bench-node", tier=Tier.DRAM, segment="dram0", offset=i << 20, length=1 << 20,
                  checksum=i, created=now, last_access=now)
        for i, k in enumerate(keys)
    ]  # fmt: skip


def percentiles(samples: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(samples, n=100)
    return statistics.median(samples), q[98]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--placements", type=int, default=10_000, help="placements to publish (default 10000)")
    ap.add_argument("--lookups", type=int, default=2_000, help="prefix lookups to time (default 2000)")
    ap.add_argument("--etcd", help="host:port of an etcd to use instead of an embedded one")
    args = ap.parse_args()
    console = Console()

    server = None if args.etcd else EmbeddedEtcd().start()
    endpoint = args.etcd or server.endpoint  # type: ignore[union-attr]
    cfg = MetadataConfig(endpoints=(endpoint,), cluster=f"bench-{uuid.uuid4().hex[:8]}")
    etcd, ns = EtcdClient(cfg), Namespace(cfg.cluster)
    store = PlacementStore(etcd, ns)
    ident = CacheIdentity(model="bench", kv_dtype="bf16", layout="all", chunk_size=16)
    try:
        keys = chunk_keys(ident, range(16 * args.placements))
        items = placements(keys)
        lease = etcd.grant_lease(60)

        t0 = time.perf_counter()
        result = store.publish(items, lease)
        publish_s = time.perf_counter() - t0
        assert len(result.created) == len(items)

        raw_keys = [ns.root + b"raw/" + k.hex().encode() for k in keys]
        values = [p.encode() for p in items]
        t0 = time.perf_counter()
        for batch in batches(list(zip(raw_keys, values, strict=True)), cfg.txn_max_ops):
            etcd.txn([], [Put(k, v, lease) for k, v in batch])
        raw_s = time.perf_counter() - t0

        prefix = keys[:PREFIX_CHUNKS]
        direct = []
        for _ in range(max(1, args.lookups // 10)):
            t0 = time.perf_counter()
            assert store.lookup_prefix(prefix) == PREFIX_CHUNKS
            direct.append(time.perf_counter() - t0)
        single_get = []
        for _ in range(max(1, args.lookups // 10)):
            t0 = time.perf_counter()
            etcd.get(ns.replica(prefix[0], "bench-node"))
            single_get.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        with MetadataCache(etcd, ns) as cache:
            snapshot_s = time.perf_counter() - t0
            cached = []
            for _ in range(args.lookups):
                t0 = time.perf_counter()
                assert cache.lookup_prefix(prefix) == PREFIX_CHUNKS
                cached.append(time.perf_counter() - t0)
        as_dict = {k: True for k in keys}
        plain = []
        for _ in range(args.lookups):
            t0 = time.perf_counter()
            sum(1 for k in prefix if k in as_dict)
            plain.append(time.perf_counter() - t0)
        rtt_us = tcp_round_trip_us()

        n = len(items)
        table = Table(title=f"kvpool metadata on etcd {endpoint} ({n} placements, {PREFIX_CHUNKS}-chunk prefix)")
        for col in ("measurement", "kvpool", "floor on this machine"):
            table.add_column(col, justify="left" if col == "measurement" else "right")
        table.add_row(
            f"publish, create-if-absent, {cfg.txn_max_ops}/txn",
            f"{n / publish_s:,.0f} placements/s",
            f"{n / raw_s:,.0f} puts/s (raw txn, no compares)",
        )
        d50, d99 = percentiles(direct)
        g50, _ = percentiles(single_get)
        table.add_row(
            f"lookup_prefix({PREFIX_CHUNKS}) via etcd (1 txn)",
            f"p50 {d50 * 1e3:.2f} ms · p99 {d99 * 1e3:.2f} ms",
            f"single get {g50 * 1e3:.2f} ms · TCP RTT {rtt_us:.0f} µs",
        )
        c50, c99 = percentiles(cached)
        p50, _ = percentiles(plain)
        table.add_row(
            f"lookup_prefix({PREFIX_CHUNKS}) via watch cache",
            f"p50 {c50 * 1e6:.1f} µs · p99 {c99 * 1e6:.1f} µs",
            f"{PREFIX_CHUNKS} dict lookups {p50 * 1e6:.1f} µs",
        )
        table.add_row(f"cache start (paged snapshot of {2 * n} keys)", f"{snapshot_s * 1e3:.0f} ms", "")
        console.print(table)
    finally:
        etcd.delete_prefix(ns.root)
        etcd.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
