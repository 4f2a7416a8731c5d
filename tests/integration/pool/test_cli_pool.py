"""kvpool ls / down / put / get / bench against a live pool, run as a user runs them (the installed script)."""

import hashlib
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import ray

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool

KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}  # with the session cluster's RAY_AUTH_MODE and RAY_AUTH_TOKEN_PATH
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


def test_put_then_get_a_file_through_the_cli(pool: PoolConfig, client: PoolClient, tmp_path: Path) -> None:
    src, back = tmp_path / "chunk.bin", tmp_path / "back.bin"
    src.write_bytes(os.urandom(300_000))
    where = [
        "--etcd",
        pool.metadata.endpoints[0],
        "--cluster",
        pool.metadata.cluster,
        "--ray-address",
        ray.get_runtime_context().gcs_address,
        "--namespace",
        pool.namespace,
    ]
    out = kvpool("put", str(src), "--replicas", "2", *where)
    assert out.returncode == 0, out.stderr
    found = re.search(r"\b[0-9a-f]{64}\b", out.stdout)
    assert found, out.stdout
    key = found.group(0)
    assert bytes.fromhex(key) == hashlib.sha256(src.read_bytes()).digest()
    assert client.cache.wait_until(lambda c: len(c.replicas(bytes.fromhex(key))) == 2, timeout_s=10)

    out = kvpool("get", key, "--out", str(back), *where)
    assert out.returncode == 0, out.stderr
    assert back.read_bytes() == src.read_bytes() and "crc32c verified" in out.stdout

    missing = kvpool("get", "ab" * 32, *where)
    assert missing.returncode == 1 and "ChunkNotFound" in missing.stderr and "Traceback" not in missing.stderr
    bad = kvpool("get", "not-a-key", *where)
    assert bad.returncode == 1 and "64 hex digits" in bad.stderr


def test_bench_on_a_running_pool_writes_table_json_and_plot(
    ray_cluster: list[str], metadata_config: MetadataConfig, tmp_path: Path
) -> None:
    """``kvpool bench`` attached to a running pool: every cell measured, the warm request reuses the cold
    one's KV and gives the same token, the plot is drawn, and the pool keeps running."""
    pool = PoolConfig(
        metadata=metadata_config, dram_bytes=32 * MiB, nvme_bytes=32 * MiB, namespace=f"bench-{uuid.uuid4().hex[:8]}"
    )  # room for the TTFT workers' calibration and KV: the fixture's 4 MiB pool is not
    start_pool(pool)
    try:
        _bench(pool, tmp_path)
    finally:
        stop_pool(pool)


def _bench(pool: PoolConfig, tmp_path: Path) -> None:
    where = [
        "--etcd",
        pool.metadata.endpoints[0],
        "--cluster",
        pool.metadata.cluster,
        "--ray-address",
        ray.get_runtime_context().gcs_address,
        "--namespace",
        pool.namespace,
    ]
    args = ["--size-mib", "1", "--mib-per-cell", "2", "--repeat", "1", "--ttft", "256", "--out", str(tmp_path / "b")]
    out = kvpool("bench", *where, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memcpy (1 thread)" in out.stdout and "TCP loopback" in out.stdout and "O_DIRECT" in out.stdout
    results = json.loads((tmp_path / "b.json").read_text())
    n = len(results["nodes"])
    assert n == 3 and len(results["put"]) == n and all(len(row) == n for row in results["put"])
    assert set(results["get"]) == {"dram", "nvme"}
    assert all(v > 0 for grid in [results["put"], *results["get"].values()] for row in grid for v in row)
    assert [s["readers"] for s in results["scaling"]] == [1, 2, 3]
    (ttft,) = results["ttft"]
    assert ttft["same_token"] == 1.0 and ttft["reused_tokens"] > 0
    assert (tmp_path / "b.png").stat().st_size > 10_000
    with PoolClient(pool) as client:
        assert len(client.cache.nodes()) == 3


def test_vllm_config_prints_the_kv_transfer_config_of_a_running_pool(pool: PoolConfig) -> None:
    """The JSON vLLM takes with --kv-transfer-config, checked by the connector's own validation; bad input is one line."""
    from kvpool.prefill_decode.vllm.config import ConnectorConfig

    where = ["--etcd", pool.metadata.endpoints[0], "--cluster", pool.metadata.cluster, "--namespace", pool.namespace]
    out = kvpool("vllm-config", *where, "--role", "kv_consumer", "--chunk-size", "512")
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)
    assert config["kv_connector"] == "KvPoolConnector" and config["kv_role"] == "kv_consumer"
    assert config["kv_connector_module_path"] == "kvpool.prefill_decode.vllm_connector"
    extra = ConnectorConfig.from_extra(config["kv_connector_extra_config"])
    assert extra.etcd == pool.metadata.endpoints and extra.cluster == pool.metadata.cluster
    assert extra.namespace == pool.namespace and extra.chunk_size == 512
    token = os.environ["RAY_AUTH_TOKEN_PATH"]  # the session cluster's: its path goes to the engine, never the token
    assert extra.ray_token_path == token and Path(token).read_text().strip() not in out.stdout + out.stderr
    assert (
        "3 live nodes" in out.stderr
        and "-m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config" in out.stderr
    )

    bad = kvpool("vllm-config", *where, "--role", "decoder")
    assert bad.returncode == 1 and "role must be one of kv_both, kv_producer, kv_consumer" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    empty = kvpool("vllm-config", "--etcd", pool.metadata.endpoints[0], "--cluster", "nobody-here")
    assert empty.returncode == 1 and "no live pool nodes in cluster 'nobody-here'" in empty.stderr
