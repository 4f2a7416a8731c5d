"""kvpool ls / down against a live pool, run as a user runs them (the installed script, a subprocess)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import ray

from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig
from kvpool.pool.keys import CacheIdentity, chunk_keys

KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([KVPOOL, *args], capture_output=True, text=True, timeout=180, env=env)


def test_ls_lists_chunks_and_down_stops_the_pool(pool: PoolConfig, client: PoolClient) -> None:
    keys = chunk_keys(CacheIdentity(model="m", kv_dtype="u8", layout="b", chunk_size=1), range(3))
    client.put_batch([(k, np.full(8192, i, dtype=np.uint8)) for i, k in enumerate(keys)])
    where = ["--etcd", pool.metadata.endpoints[0], "--cluster", pool.metadata.cluster]

    out = kvpool("ls", *where)
    assert out.returncode == 0, out.stderr
    assert "3 chunks" in out.stdout and all(k.hex()[:16] in out.stdout for k in keys)
    assert "dram @" in out.stdout and "8192" in out.stdout
    assert "0 chunks" in kvpool("ls", *where, "--node", "no-such-node").stdout

    out = kvpool("down", "--ray-address", ray.get_runtime_context().gcs_address, "--namespace", pool.namespace)
    assert out.returncode == 0, out.stderr
    assert "stopped 3 pool node(s)" in out.stdout
    assert client.cache.wait_until(lambda c: not c.nodes() and not c.chunk_count(), timeout_s=10)
