"""Every miss explained, each cause produced for real on a real pool: chunks evicted by filling DRAM and NVMe,
removed, dropped as corrupt after a flipped byte, gone with a killed node, held under another cache identity, and
never stored; ``explain`` from a watch cache that saw it all and from a fresh one (tombstones, departures and
etcd's history); and ``kvpool explain`` itself."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.errors import CorruptChunk
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.misses import MissCause, explain, miss_cause
from kvpool.metadata.namespace import Namespace
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.protocol import actor_name

KVPOOL = str(Path(sys.executable).with_name("kvpool"))
ONE = CacheIdentity(model="misses", kv_dtype="u8", layout="b", chunk_size=4)
OTHER = CacheIdentity(model="misses", kv_dtype="u16", layout="b", chunk_size=4)


def _prompt(seed: int, chunks: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, chunks * 4)]


def _causes(rows: list) -> list[MissCause | None]:
    return [r.cause for r in rows]


def test_evicted_removed_corrupt_and_never_stored(pool: PoolConfig, client: PoolClient, ray_cluster: list[str]) -> None:
    here = ray_cluster[0]
    prompt = _prompt(1, 16)
    keys = chunk_keys(ONE, prompt)
    data = np.zeros(MiB, dtype=np.uint8)
    for key in keys:  # one at a time, oldest first: 16 MiB through 4 MiB of DRAM and 8 of NVMe
        client.put_batch([(key, data)], nodes=[here])
    client.remove_batch(keys[-2:-1])
    [p] = client.cache.replicas(keys[-1])
    bound = client.local.current()
    assert p.tier is Tier.DRAM and bound is not None
    bound.segment.write(p.offset, b"\xff" * 16)  # flip bytes behind the pool's back
    with pytest.raises(CorruptChunk):
        client.get(keys[-1])
    client.cache.sync()

    rows = explain(client.cache, client.etcd, ONE, [*prompt, 1, 2])  # a partial chunk at the end: not a chunk
    assert len(rows) == 16
    assert rows[-1].cause is MissCause.CORRUPT and "corrupt" in rows[-1].detail and here in rows[-1].detail
    assert rows[-2].cause is MissCause.REMOVED and "removed from dram" in rows[-2].detail
    evicted = [r for r in rows if r.cause is MissCause.EVICTED]
    assert evicted and evicted[0].index == 0  # the oldest went first
    assert all("by lru" in r.detail and here in r.detail for r in evicted)
    held = [r for r in rows if r.cause is None]
    assert held and all(r.held and r.detail.startswith("held: ") for r in held)
    assert {r.held[0].tier for r in held} <= {Tier.DRAM, Tier.NVME}

    never = explain(client.cache, client.etcd, ONE, _prompt(2, 2))
    assert _causes(never) == [MissCause.NEVER_STORED] * 2
    assert miss_cause(client.cache, [keys[0]])[0] is MissCause.EVICTED
    stats = client._stats
    stats.report(force=True)
    node, stats.node = stats.node, None  # hold the counts here (not handed to the node) to read them
    try:
        assert client.lookup_prefix(keys) == 0  # the first chunk was evicted: counted under its cause
        assert stats.seen.misses == {"evicted": 1}
    finally:
        stats.node = node

    with MetadataCache(client.etcd, Namespace(pool.metadata.cluster)) as fresh:  # a later client: the tombstones
        assert _causes(explain(fresh, client.etcd, ONE, prompt)) == _causes(rows)


def test_node_left_and_another_identity(pool: PoolConfig, client: PoolClient, ray_cluster: list[str]) -> None:
    here, victim = ray_cluster[0], ray_cluster[2]
    prompt = _prompt(3, 4)
    data = np.ones(1024, dtype=np.uint8)
    client.register_identity(ONE)
    client.register_identity(OTHER)
    client.put_batch([(k, data) for k in chunk_keys(ONE, prompt)[:2]], nodes=[here])
    client.put_batch([(k, data) for k in chunk_keys(ONE, prompt)[2:]], nodes=[victim])
    client.put_batch([(k, data) for k in chunk_keys(OTHER, prompt)], nodes=[here])
    client.cache.sync()

    rows = explain(client.cache, client.etcd, OTHER, prompt)
    assert _causes(rows) == [None] * 4
    ray.kill(ray.get_actor(actor_name(victim), namespace=pool.namespace))  # its lease runs out, its keys go
    late = chunk_keys(ONE, prompt)[2:]
    assert client.cache.wait_until(lambda c: not any(c.replicas(k) for k in late), timeout_s=60)
    assert client.cache.wait_until(lambda c: victim in c.departures(), timeout_s=30)  # recorded by the survivors

    rows = explain(client.cache, client.etcd, ONE, prompt)
    assert _causes(rows) == [None, None, MissCause.NODE_LEFT, MissCause.NODE_LEFT]
    assert victim in rows[2].detail and "dram" in rows[2].detail
    with MetadataCache(client.etcd, Namespace(pool.metadata.cluster)) as fresh:  # from etcd's history
        again = explain(fresh, client.etcd, ONE, prompt)
        assert _causes(again) == _causes(rows) and "etcd revision" in again[3].detail

    client.remove_batch(chunk_keys(ONE, prompt)[:2])  # now only the other identity holds the first two chunks
    client.cache.sync()
    mixed = explain(client.cache, client.etcd, ONE, prompt[:8])
    # the tombstone (removed) is the newer, surer cause; a prompt never put under ONE shows the other identity
    assert _causes(mixed) == [MissCause.REMOVED] * 2
    other_only = _prompt(4, 2)
    client.put_batch([(k, data) for k in chunk_keys(OTHER, other_only)], nodes=[here])
    client.cache.sync()
    rows = explain(client.cache, client.etcd, ONE, other_only)
    assert _causes(rows) == [MissCause.OTHER_IDENTITY] * 2
    assert "kv_dtype: u16 here vs u8 asked" in rows[0].detail


def test_kvpool_explain(pool: PoolConfig, client: PoolClient, tmp_path: Path) -> None:
    """The command: a table, JSON, the last line's reusable prefix; bad input is one line and exit 1."""
    prompt = _prompt(5, 3)
    client.register_identity(ONE)
    client.put_batch([(k, np.ones(64, dtype=np.uint8)) for k in chunk_keys(ONE, prompt)[:2]])
    client.remove_batch(chunk_keys(ONE, prompt)[1:2])
    client.cache.sync()
    where = ["--etcd", pool.metadata.endpoints[0], "--cluster", pool.metadata.cluster]
    env = {**os.environ, "COLUMNS": "200"}
    ids = tmp_path / "prompt.txt"
    ids.write_text(" ".join(map(str, prompt)))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([KVPOOL, "explain", *args, *where], capture_output=True, text=True, timeout=120, env=env)

    done = run(str(ids), "--model", "misses")
    assert done.returncode == 0, done.stderr
    assert "held" in done.stdout and "removed" in done.stdout and "never_stored" in done.stdout
    assert "reuses the first 1 chunks (4 tokens)" in done.stdout
    rows = [
        json.loads(line)
        for line in run("--tokens", ",".join(map(str, prompt)), "--model", "misses", "--json").stdout.splitlines()
    ]
    assert [r["cause"] for r in rows] == [None, "removed", "never_stored"]
    for args, said in (
        (("--model", "misses"), "give PROMPT or --tokens"),
        ((str(ids), "--model", "nobody"), "registered models: misses"),
        ((str(ids),), "give --model"),
        (("--tokens", "1,x", "--model", "misses"), "token ids"),
        ((str(ids), "--identity", "ffff"), "matches 0 of the 1 registered identities"),
    ):
        bad = run(*args)
        assert bad.returncode == 1 and said in bad.stdout + bad.stderr, (args, bad.stdout, bad.stderr)
