"""The remote tier inside a real pool: Ray + etcd + NIXL + SeaweedFS, codecs per tier.

Idle NVMe chunks flush to S3 under the remote codec; their placements outlive the nodes; a remote-only chunk
is served (decoded, verified) and promoted; remote errors are misses that lose nothing in the other tiers.
"""

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import ray
import torch

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Placement, Tier
from kvpool.errors import ChunkNotFound
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.protocol import actor_name
from kvpool.pool.tiers.s3 import RemoteStore
from kvpool.pool.tiers.s3_config import RemoteConfig

SHAPE = (64, 2, 4, 64)  # [tokens, K/V, heads, head dim]: 128 KiB of float32 per chunk
IDENTITY = "0123456789abcdef"  #: the cache identity fingerprint the chunks are written under
MakePool = Callable[..., PoolConfig]


def kv(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


def keys_of(n: int) -> list[bytes]:
    identity = CacheIdentity(model=f"remote-{uuid.uuid4().hex[:8]}", kv_dtype="float32", layout="t", chunk_size=1)
    return chunk_keys(identity, range(n))


def wait_for(what: str, predicate: Callable[[], bool], timeout_s: float = 30.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start


def in_tier(client: PoolClient, key: bytes, tier: Tier) -> Placement | None:
    return next((p for p in client.cache.replicas(key) if p.tier is tier), None)


@pytest.fixture
def make_pool(ray_cluster: list[str], metadata_config: MetadataConfig, tmp_path: Path) -> Iterator[MakePool]:
    """Pools on the head node sharing the test's etcd cluster (so placements outlive a pool); stopped after.  Each
    starts with an empty NVMe tier (no warm restart): what a later pool finds must come from S3."""
    started: list[PoolConfig] = []

    def make(remote: RemoteConfig, **kw: Any) -> PoolConfig:
        config = PoolConfig(
            metadata=metadata_config,
            namespace=f"remote-{uuid.uuid4().hex[:8]}",
            dram_bytes=4 * MiB,
            nvme_bytes=8 * MiB,
            nvme_dir=str(tmp_path),
            warm_restart=False,
            remote=remote,
            **kw,
        )
        start_pool(config, ray_cluster[:1])
        started.append(config)
        return config

    yield make
    for config in started:
        stop_pool(config)


def test_idle_chunks_flush_to_s3_outlive_the_node_and_are_served_from_there(
    make_pool: MakePool, s3_bucket: RemoteConfig, metadata_config: MetadataConfig
) -> None:
    remote = msgspec.structs.replace(s3_bucket, codec="int4+zstd")
    pool = make_pool(remote, nvme_codec="fp8-e4m3")
    keys = keys_of(10)
    tensors = [kv(i) for i in range(8)]
    blobs = [np.random.default_rng(i).integers(0, 256, 100_000, dtype=np.uint8).tobytes() for i in (8, 9)]
    with PoolClient(pool) as client:
        client.put_batch([*zip(keys[:8], tensors, strict=True), *zip(keys[8:], blobs, strict=True)], identity=IDENTITY)
        client.move(keys, Tier.NVME)
        on_nvme = [in_tier(client, k, Tier.NVME) for k in keys]
        assert all(p is not None for p in on_nvme)
        assert [p.codec for p in on_nvme if p] == ["fp8-e4m3"] * 8 + ["raw"] * 2  # bytes have no format: raw
        assert all(p.stored < p.size / 3.5 for p in on_nvme[:8] if p)
        flushed_in = wait_for("every chunk flushed", lambda: all(in_tier(client, k, Tier.REMOTE) for k in keys))
        in_remote = [in_tier(client, k, Tier.REMOTE) for k in keys]
        assert [p.codec for p in in_remote if p] == ["int4+zstd"] * 8 + ["raw"] * 2
        assert {p.node for p in in_remote if p} == {remote.name} and {p.identity for p in in_remote if p} == {IDENTITY}
        with RemoteStore(remote, metadata_config.cluster) as store:
            assert len(list(store.list_objects())) == 10
        stats = client.stats()["nodes"]
        [node] = stats.values()
        assert node["flushed"] == 10 and node["encoded"] >= 8 and node["codecs"]["remote"] == "int4+zstd"
        print(f"\n10 chunks flushed {flushed_in:.1f} s after the move (flush_after_s {remote.flush_after_s})")

    stop_pool(pool)  # the node's lease goes with its placements; the remote ones are on no lease
    pool = make_pool(remote)  # a fresh node, same etcd cluster: it holds nothing
    with PoolClient(pool) as client:
        client.cache.sync()
        assert all(not any(p.tier is not Tier.REMOTE for p in client.cache.replicas(k)) for k in keys)
        got = client.get_batch(keys)
        for t, raw in zip(tensors, got[:8], strict=True):
            back = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(SHAPE)
            assert (back - t).abs().max() <= 0.3 * t.abs().max()  # int4 groups of 32: within half a step
        assert got[8:] == blobs  # raw: exact
        promoted = [in_tier(client, k, Tier.DRAM) for k in keys]
        assert all(promoted) and {p.identity for p in promoted if p} == {IDENTITY}  # promoted on the hit, as written
        assert client.remove_batch(keys) == 10
        assert not any(client.exists(k) for k in keys)
        with RemoteStore(remote, metadata_config.cluster) as store:
            assert list(store.list_objects()) == []


def test_remote_errors_are_misses_and_lose_nothing(
    make_pool: MakePool, s3_bucket: RemoteConfig, metadata_config: MetadataConfig, ray_cluster: list[str]
) -> None:
    """Flushes refused (endpoint down) leave chunks on NVMe; remote reads refused (endpoint down, 403) or of
    vanished objects are misses; only the placement of a vanished object is dropped; gc reconciles."""
    keys = keys_of(4)
    tensors = [kv(i) for i in range(4)]
    dead = msgspec.structs.replace(s3_bucket, endpoint_url="http://127.0.0.1:9", timeout_s=0.5)  # nobody listens
    pool = make_pool(dead)
    with PoolClient(pool) as client:
        client.put_batch(list(zip(keys, tensors, strict=True)))
        client.move(keys, Tier.NVME)
        node = ray.get_actor(actor_name(ray_cluster[0]), namespace=pool.namespace)
        wait_for("a refused flush", lambda: ray.get(node.stats.remote())["remote_errors"] >= 2)
        assert not any(in_tier(client, k, Tier.REMOTE) for k in keys)
        assert [bytes(t.view(torch.uint8).numpy()) for t in tensors] == client.get_batch(keys)  # nothing lost
    stop_pool(pool)

    # Chunks only in S3, read by clients that cannot reach it, or whose objects are gone.
    pool = make_pool(s3_bucket)
    with PoolClient(pool) as client:
        client.put_batch(list(zip(keys, tensors, strict=True)))
        client.move(keys, Tier.NVME)
        wait_for("every chunk flushed", lambda: all(in_tier(client, k, Tier.REMOTE) for k in keys))
    stop_pool(pool)
    for remote, what in ((dead, "endpoint down"), (msgspec.structs.replace(s3_bucket, secret_access_key="x"), "403")):
        pool = make_pool(remote)
        with PoolClient(pool) as client:
            client.cache.sync()
            with pytest.raises(ChunkNotFound, match="no replica could be read"):
                client.get(keys[0])
            assert in_tier(client, keys[0], Tier.REMOTE), f"{what}: the placement is kept, the object is fine"
        stop_pool(pool)
    pool = make_pool(s3_bucket)
    with PoolClient(pool) as client, RemoteStore(s3_bucket, metadata_config.cluster) as store:
        client.cache.sync()
        store.delete([(keys[1], "raw")])  # the object vanishes behind the pool's back
        with pytest.raises(ChunkNotFound):
            client.get(keys[1])
        assert not client.exists(keys[1])  # its placement was dropped
        assert client.get(keys[2]) == bytes(tensors[2].view(torch.uint8).numpy())

        # gc: an object no placement names (after the grace period) goes; a placement with no object goes.
        store.put(keys_of(1)[0], "raw", b"orphan")
        store.delete([(keys[3], "raw")])
        assert client.remote_gc(grace_s=0) == (1, 1)
        left = sorted(o.name for o in store.list_objects())
        assert left == sorted(store.object_name(k, "raw") for k in (keys[0], keys[2]))
