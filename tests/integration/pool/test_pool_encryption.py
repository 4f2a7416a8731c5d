"""Encryption at rest in a real pool (Ray + etcd + NIXL, and SeaweedFS for the remote tier).

Chunks demoted to NVMe are sealed on disk and read back by the pool's own clients; a client with another key
misses them and leaves them to the others; chunks flushed to S3 are sealed objects, which a node configured with
another key treats as misses.
"""

import base64
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Placement, Tier
from kvpool.errors import ChunkNotFound
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.tiers.crypto import KEY_BYTES, EncryptionConfig
from kvpool.pool.tiers.s3 import RemoteStore
from kvpool.pool.tiers.s3_config import RemoteConfig

MakePool = Callable[..., PoolConfig]


def keys_file(path: Path, key_id: str = "k1") -> EncryptionConfig:
    path.write_text(f"{key_id} {base64.b64encode(os.urandom(KEY_BYTES)).decode()}\n")
    path.chmod(0o600)
    return EncryptionConfig(key_file=str(path))


def keys_of(n: int) -> list[bytes]:
    identity = CacheIdentity(model=f"enc-{uuid.uuid4().hex[:8]}", kv_dtype="float32", layout="t", chunk_size=1)
    return chunk_keys(identity, range(n))


def blob(i: int) -> bytes:
    """Recognisable plain bytes (a prompt's KV would be as readable on disk): a marker, repeated."""
    return (f"PLAINTEXT-{i:04d}-".encode() * 8192)[:100_000]


def in_tier(client: PoolClient, key: bytes, tier: Tier) -> Placement | None:
    return next((p for p in client.cache.replicas(key) if p.tier is tier), None)


def disk(directory: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file())


@pytest.fixture
def make_pool(ray_cluster: list[str], metadata_config: MetadataConfig, tmp_path: Path) -> Iterator[MakePool]:
    """Pools on the head node sharing the test's etcd cluster, each with its own NVMe directory; stopped after."""
    started: list[PoolConfig] = []

    def make(**kw: Any) -> PoolConfig:
        nvme = tmp_path / f"nvme{len(started)}"
        nvme.mkdir()
        config = PoolConfig(
            metadata=metadata_config,
            namespace=f"enc-{uuid.uuid4().hex[:8]}",
            dram_bytes=4 * MiB,
            nvme_bytes=8 * MiB,
            nvme_dir=str(nvme),
            warm_restart=False,
            **kw,
        )
        start_pool(config, ray_cluster[:1])
        started.append(config)
        return config

    yield make
    for config in started:
        stop_pool(config)


def test_nvme_chunks_are_sealed_on_disk_and_other_keys_miss(make_pool: MakePool, tmp_path: Path) -> None:
    encryption = keys_file(tmp_path / "keys")
    pool = make_pool(encryption=encryption, nvme_codec="fp8-e4m3", promote_on_hit=False)
    keys = keys_of(5)
    blobs = [blob(i) for i in range(4)]
    tensor = torch.randn((64, 2, 4, 64), generator=torch.Generator().manual_seed(0))
    with PoolClient(pool) as client:
        client.put_batch([*zip(keys[:4], blobs, strict=True), (keys[4], tensor)])
        client.move(keys, Tier.NVME)
        on_nvme = [in_tier(client, k, Tier.NVME) for k in keys]
        assert [p.codec if p else None for p in on_nvme] == ["raw+aes256gcm"] * 4 + ["fp8-e4m3+aes256gcm"]
        on_disk = disk(Path(pool.nvme_dir))
        assert b"PLAINTEXT-" not in on_disk  # no chunk's bytes in the clear, not even a piece of one
        assert bytes(tensor.view(torch.uint8).numpy())[:4096] not in on_disk
        got = client.get_batch(keys)  # promote_on_hit off: the client opens what it reads from the segment file
        assert got[:4] == blobs
        back = torch.frombuffer(bytearray(got[4]), dtype=torch.float32).view(tensor.shape)
        assert (back - tensor).abs().max() <= 0.07 * tensor.abs().max()

    other = msgspec.structs.replace(pool, encryption=keys_file(tmp_path / "other"))  # the same key id, another key
    with PoolClient(other) as stranger:
        for key in keys[:2]:
            with pytest.raises(ChunkNotFound, match="no replica could be read"):
                stranger.get(key)
    with PoolClient(pool) as client:  # nothing was dropped for the stranger's sake
        assert all(in_tier(client, k, Tier.NVME) for k in keys) and client.get(keys[0]) == blobs[0]
        client.move(keys[:1], Tier.DRAM)  # promotion opens the chunk in the node: DRAM is raw
        dram = in_tier(client, keys[0], Tier.DRAM)
        assert dram is not None and dram.codec == "raw" and client.get(keys[0]) == blobs[0]


def test_s3_objects_are_sealed_and_a_node_with_another_key_misses(
    make_pool: MakePool, s3_bucket: RemoteConfig, metadata_config: MetadataConfig, tmp_path: Path
) -> None:
    nvme_keys = keys_file(tmp_path / "nvme", "nvme1")
    remote = msgspec.structs.replace(s3_bucket, codec="int4+zstd", encryption=keys_file(tmp_path / "s3", "s3-1"))
    keys = keys_of(3)
    blobs = [blob(i) for i in range(3)]
    pool = make_pool(remote=remote, encryption=nvme_keys)
    with PoolClient(pool) as client:
        client.put_batch(list(zip(keys, blobs, strict=True)))
        client.move(keys, Tier.NVME)
        deadline = time.monotonic() + 60
        while not all(in_tier(client, k, Tier.REMOTE) for k in keys):
            assert time.monotonic() < deadline, "chunks not flushed to S3 within 60 s"
            time.sleep(0.1)
        assert {p.codec for k in keys if (p := in_tier(client, k, Tier.REMOTE))} == {"raw+aes256gcm"}
    with RemoteStore(remote, metadata_config.cluster) as store:
        objects = [store.get(k, "raw+aes256gcm") for k in keys]
    assert not any(b"PLAINTEXT-" in o for o in objects)
    stop_pool(pool)  # only the S3 copies are left

    stranger = make_pool(remote=msgspec.structs.replace(remote, encryption=keys_file(tmp_path / "s3b", "s3-1")))
    with PoolClient(stranger) as client:
        client.cache.sync()
        with pytest.raises(ChunkNotFound, match="no replica could be read"):
            client.get(keys[0])
        assert in_tier(client, keys[0], Tier.REMOTE)  # kept: the object is fine, this node lacks the key
    stop_pool(stranger)
    pool = make_pool(remote=remote, encryption=nvme_keys)
    with PoolClient(pool) as client:
        client.cache.sync()
        assert client.get_batch(keys) == blobs
