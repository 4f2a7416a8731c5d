"""A client killed with a room open on a node, its batch half written (Mooncake's PutStart without PutEnd), leaves
no orphan space: the node reclaims the room within its TTL (plus half a TTL for the reaper's turn)."""

import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import ray

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.protocol import actor_name

TTL_S = 1.0
KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, ray
    ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level="ERROR")
    node = ray.get_actor(sys.argv[3], namespace=sys.argv[2])
    ray.get(node.prepare_store.remote(3 << 20))  # 3 MiB set aside for a batch ...
    print("opened", flush=True)
    os._exit(9)  # ... and the writer dies before handing it over
    """
)


@pytest.fixture
def pool(ray_cluster: list[str], metadata_config: MetadataConfig) -> Iterator[PoolConfig]:
    config = PoolConfig(
        metadata=metadata_config,
        dram_bytes=4 * MiB,
        nvme_bytes=-1,
        reservation_ttl_s=TTL_S,
        namespace=f"orphans-{uuid.uuid4().hex[:8]}",
    )
    start_pool(config, ray_cluster[:1])
    yield config
    stop_pool(config)


def test_a_writer_killed_with_a_room_open_leaves_no_orphan_space(pool: PoolConfig, ray_cluster: list[str]) -> None:
    node = ray.get_actor(actor_name(ray_cluster[0]), namespace=pool.namespace)
    args = [ray.get_runtime_context().gcs_address, pool.namespace, actor_name(ray_cluster[0])]
    done = subprocess.run(  # with the session cluster's token (RAY_AUTH_TOKEN_PATH in this environment)
        [sys.executable, "-c", KILLED_WRITER, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 9 and "opened" in done.stdout, done.stderr[-2000:]
    killed_at = time.monotonic()

    def dram_used() -> int:
        return int(ray.get(node.stats.remote())["tiers"]["dram"]["used"])

    while dram_used() and time.monotonic() - killed_at < 10 * TTL_S:
        time.sleep(0.1)
    assert dram_used() == 0, "the dead writer's room was never reclaimed"
    stats = ray.get(node.stats.remote())
    assert stats["reaped"] == 1
    with PoolClient(pool) as client:  # the whole segment is usable again
        keys = chunk_keys(CacheIdentity(model="orphans", kv_dtype="u8", layout="b", chunk_size=1), range(3))
        client.put_batch([(k, np.full(1 << 20, i, dtype=np.uint8)) for i, k in enumerate(keys)], nodes=[ray_cluster[0]])
        assert client.get(keys[2]) == bytes([2]) * (1 << 20)
