"""Warm restart: a node killed whole (every process of its Ray node SIGKILLed) and joined again with ``kvpool join``
on the same host and NVMe directory serves its NVMe chunks again, without anyone putting them; a chunk whose bytes
rotted on disk while it was down is dropped (a miss, its tombstone says corrupt), never served."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import ray
from ray_nodes import extra_ray_node

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.errors import ChunkNotFound
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.misses import MissCause, miss_cause
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.node.journal import segment_name
from kvpool.pool.protocol import actor_name

IP = "127.0.0.11"
CHUNK = 256 * 1024
KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def blob(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def wait_for(what: str, done: "callable[[], bool]", timeout_s: float = 120.0) -> None:  # type: ignore[valid-type]
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.2)


def test_a_node_killed_whole_and_joined_again_serves_its_nvme_chunks(
    ray_cluster: list[str], metadata_config: MetadataConfig, tmp_path: Path
) -> None:
    pool = PoolConfig(
        metadata=metadata_config,
        namespace=f"warm-{uuid.uuid4().hex[:8]}",
        dram_bytes=4 * MiB,
        nvme_bytes=16 * MiB,
        nvme_dir=str(tmp_path),
        metrics_port=-1,
    )
    keys = chunk_keys(CacheIdentity(model="warm", kv_dtype="u8", layout="b", chunk_size=1), range(24))
    with PoolClient(pool) as client:
        with extra_ray_node(IP) as (first, kill):
            start_pool(pool, [first])
            client.put_batch([(k, blob(i)) for i, k in enumerate(keys)], nodes=[first])
            client.move(keys, Tier.NVME)
            rotten = client.cache.replicas(keys[5])[0]
            assert rotten.tier is Tier.NVME
            kill()
            wait_for("the killed node's placements to expire", lambda: not any(client.exists_batch(keys)))
            wait_for(
                "Ray to see the node dead", lambda: not any(n["Alive"] and n["NodeID"] == first for n in ray.nodes())
            )
        segment = tmp_path / f"kvpool-{segment_name(metadata_config.cluster, IP)}.nvme"
        with open(segment, "r+b") as f:  # one byte rots while the node is down
            f.seek(rotten.offset + 777)
            byte = f.read(1)
            f.seek(rotten.offset + 777)
            f.write(bytes([byte[0] ^ 0x10]))

        with extra_ray_node(IP) as (second, _):
            began = time.monotonic()
            joined = subprocess.run(
                [
                    KVPOOL,
                    "join",
                    "--ray-address",
                    ray.get_runtime_context().gcs_address,
                    "--node-ip",
                    IP,
                    "--etcd",
                    metadata_config.endpoints[0],
                    "--cluster",
                    metadata_config.cluster,
                    "--namespace",
                    pool.namespace,
                    "--nvme-dir",
                    str(tmp_path),
                    "--dram-mib",
                    "4",
                    "--nvme-mib",
                    "16",
                ],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "COLUMNS": "500"},
            )
            assert joined.returncode == 0, joined.stderr
            assert "took back 23 NVMe chunks" in joined.stdout and "1 did not verify" in joined.stdout
            client.cache.sync()
            stats = ray.get(ray.get_actor(actor_name(second), namespace=pool.namespace).stats.remote())
            print(
                f"\nwarm restart: kvpool join took {time.monotonic() - began:.1f} s; took back {stats['recovered']} "
                f"chunks ({stats['restart']['bytes'] / MiB:.1f} MiB read and verified in "
                f"{stats['restart']['seconds'] * 1e3:.0f} ms), dropped {stats['recovery_dropped']}"
            )
            assert (stats["recovered"], stats["recovery_dropped"]) == (23, 1)
            for i, key in enumerate(keys):  # served by the new node, from what the old one left on disk
                if i == 5:
                    continue
                assert [p.node for p in client.cache.replicas(key)] == [second]
                assert client.get(key) == blob(i)
            try:
                client.get(keys[5])
                raise AssertionError("a chunk whose bytes rotted was served")
            except ChunkNotFound:
                pass
            assert miss_cause(client.cache, [keys[5]])[0] is MissCause.CORRUPT
            stop_pool(pool)
