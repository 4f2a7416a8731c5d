"""A bounded soak: mixed put/get/remove traffic across 3 nodes (DRAM small enough that chunks keep migrating
to NVMe and back), with bytes flipped in DRAM now and then.  Every get returns the bytes put or a miss; each
process's memory, open files and transport registrations stay flat after warm-up.

The suite's run is 20 s of traffic (``--soak-s``): long enough for every tier to fill and chunks to be evicted and
moved many times over, for flipped bytes to be read, and for a leak per operation (of a chunk's buffer, an open file,
a transport registration) to show against the slack below; a slow leak needs a longer run:
``pytest tests/faults/test_soak.py --soak-s 600 -s``.
"""

import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.errors import ChunkNotFound, PoolFull
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.protocol import NodeInfo, actor_name
from kvpool.pool.segment import DramSegment

WARM_UP = 0.3  #: the first 30 % of the run fills the tiers and the allocators; growth is measured after it
RSS_SLACK = 48 * MiB  #: allowed RSS growth after warm-up (allocator arenas, Ray's and gRPC's buffers settle)
FD_SLACK = 8


def blob(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def rss_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss_kib * 1024, len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
def test_soak(
    ray_cluster: list[str], metadata_config: MetadataConfig, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    duration = float(request.config.getoption("--soak-s"))
    pool = PoolConfig(
        metadata=metadata_config,
        namespace=f"soak-{uuid.uuid4().hex[:8]}",
        dram_bytes=4 * MiB,
        nvme_bytes=8 * MiB,
        nvme_dir=str(tmp_path),
    )
    start_pool(pool, ray_cluster)
    keys = iter(chunk_keys(CacheIdentity(model="soak", kv_dtype="u8", layout="b", chunk_size=1), range(10**7)))
    rng = random.Random(11)
    live: dict[bytes, tuple[int, int]] = {}  # key -> (seed, size)
    ops: Counter[str] = Counter()
    try:
        with PoolClient(pool) as client:
            head = ray.get_actor(actor_name(ray_cluster[0]), namespace=pool.namespace)
            info: NodeInfo = ray.get(head.info.remote())
            dram = DramSegment.attach(info.dram_path, info.dram_capacity)  # where the faults are injected
            pids = {"driver": os.getpid(), **{f"node{i}": n.pid for i, n in enumerate(client.cache.nodes())}}
            actors = [ray.get_actor(actor_name(n), namespace=pool.namespace) for n in ray_cluster]
            samples: dict[str, list[tuple[int, int]]] = {name: [] for name in pids}
            registrations: list[tuple[int, ...]] = []
            start = time.monotonic()
            warm_at, end, sample_at = start + WARM_UP * duration, start + duration, start
            baseline: dict[str, tuple[int, int]] = {}
            while (now := time.monotonic()) < end:
                if now >= sample_at:
                    for name, pid in pids.items():
                        samples[name].append(rss_and_fds(pid))
                    registrations.append(
                        (client.registrations, *(ray.get(a.stats.remote())["registrations"] for a in actors))
                    )
                    if now >= warm_at and not baseline:
                        baseline = {name: s[-1] for name, s in samples.items()}
                    sample_at = now + max(duration / 30, 1.0)
                _one_operation(client, dram, rng, keys, live, ops, ray_cluster)
            elapsed = time.monotonic() - start
            for key in list(live):  # every chunk still listed reads back intact, or is a miss (evicted)
                _verified_get(client, key, live, ops)
            dram.close()
    finally:
        stop_pool(pool)

    done = sum(n for op, n in ops.items() if op in ("puts", "gets", "removes"))
    print(f"\nsoak {elapsed:.0f} s, 3 nodes: {done} operations ({done / elapsed:.0f}/s), {dict(ops)}")
    for name, s in samples.items():
        print(
            f"  {name:7s} RSS max {max(r for r, _ in s) / MiB:6.1f} MiB (after warm-up {baseline[name][0] / MiB:6.1f} "
            f"→ end {s[-1][0] / MiB:6.1f}), open files {baseline[name][1]} → {s[-1][1]}"
        )
    print(
        f"  registrations (client, nodes) after warm-up {registrations[len(registrations) // 3]} → end {registrations[-1]}"
    )
    assert ops["mismatches"] == 0
    for name, s in samples.items():
        assert max(r for r, _ in s[len(s) // 3 :]) <= baseline[name][0] + RSS_SLACK, f"{name} memory grows: {s}"
        assert s[-1][1] <= baseline[name][1] + FD_SLACK, f"{name} leaks file descriptors: {s}"
    assert all(r == registrations[len(registrations) // 3] for r in registrations[len(registrations) // 3 :])


def _one_operation(
    client: PoolClient,
    dram: DramSegment,
    rng: random.Random,
    keys: Iterator[bytes],
    live: dict[bytes, tuple[int, int]],
    ops: Counter[str],
    nodes: list[str],
) -> None:
    """One random operation: put (35 %), get (50 %), remove (13 %) or a byte flip in the head's DRAM (2 %)."""
    roll = rng.random()
    if roll < 0.35 or len(live) < 8:
        items = [(next(keys), rng.randrange(1000), rng.choice((16, 64, 200)) * 1024) for _ in range(rng.randint(1, 4))]
        target = rng.sample(nodes, 2) if rng.random() < 0.2 else [rng.choice(nodes)]
        try:
            client.put_batch([(k, blob(seed, size)) for k, seed, size in items], nodes=target)
        except PoolFull:
            ops["puts_refused"] += 1
            return
        live.update({k: (seed, size) for k, seed, size in items})
        ops["puts"] += len(items)
    elif roll < 0.85:
        for key in rng.sample(list(live), min(4, len(live))):
            _verified_get(client, key, live, ops)
    elif roll < 0.98:
        gone = rng.sample(list(live), min(3, len(live)))
        client.remove_batch(gone)
        for key in gone:
            del live[key]
        ops["removes"] += len(gone)
    else:
        on_head = [
            (k, p)
            for k in rng.sample(list(live), min(20, len(live)))
            for p in client.cache.replicas(k)
            if p.node == nodes[0] and p.tier is Tier.DRAM and len(client.cache.replicas(k)) == 1
        ]
        if not on_head:
            return
        key, p = on_head[0]
        at = p.offset + rng.randrange(p.stored)
        byte = bytearray(dram.view(at, 1))
        dram.write(at, bytes([byte[0] ^ 0x5A]))
        ops["flips"] += 1
        missed_before = ops["misses"]
        _verified_get(client, key, live, ops)  # a miss (CorruptChunk), or the right bytes if it moved first
        ops["flips_served_as_misses"] += ops["misses"] > missed_before


def _verified_get(client: PoolClient, key: bytes, live: dict[bytes, tuple[int, int]], ops: Counter[str]) -> None:
    ops["gets"] += 1
    try:
        got = client.get(key)
    except ChunkNotFound:  # evicted to make room, or corrupt and dropped: a miss, the key is gone
        ops["misses"] += 1
        del live[key]
        return
    if got != blob(*live[key]):
        ops["mismatches"] += 1
