"""``kvpool sglang-config`` against a running pool, run as a user runs it: the flags it prints load the backend
through SGLang's own factory, and it reaches the pool they name."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from hicache import PAGE, host_pool, storage_config
from sglang_needed import sglang_module

from kvpool.pool.config import PoolConfig

sglang_module("sglang.srt.mem_cache.hicache_storage")  # a skip where SGLang is not installed (see sglang_needed)

from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from kvpool.prefill_decode.sglang.storage import KvPoolStorage  # noqa: E402

KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}  # with the session cluster's RAY_AUTH_MODE and RAY_AUTH_TOKEN_PATH
    return subprocess.run([sys.executable, KVPOOL, *args], capture_output=True, text=True, timeout=180, env=env)


def test_the_printed_flags_make_a_working_backend(sglang_pool: PoolConfig) -> None:
    meta = sglang_pool.metadata
    where = ["--etcd", meta.endpoints[0], "--cluster", meta.cluster, "--namespace", sglang_pool.namespace]
    out = kvpool("sglang-config", *where, "--replicas", "2")
    assert out.returncode == 0, out.stderr
    flags = shlex.split(out.stdout)
    assert flags[:3] == ["--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic"]
    assert flags[3] == "--hicache-storage-backend-extra-config"
    extra = json.loads(flags[4])
    assert extra == json.loads(kvpool("sglang-config", *where, "--replicas", "2", "--json").stdout)
    token = os.environ["RAY_AUTH_TOKEN_PATH"]  # its path goes to the server, never the token
    assert extra["ray_token_path"] == token and Path(token).read_text().strip() not in out.stdout + out.stderr
    assert "3 live nodes" in out.stderr

    host = host_pool("page_first")
    store = StorageBackendFactory.create_backend("dynamic", storage_config(extra), host)
    assert isinstance(store, KvPoolStorage)
    store.register_mem_pool_host(host)
    try:
        keys = get_hash_str(list(range(2 * PAGE)), None, page_size=PAGE)
        slots = host.alloc(2 * PAGE)
        assert store.batch_set_v1(keys, slots) == [True, True]
        assert len(store.connection.connected.cache.replicas(store.keys(keys)[0])) == 2  # replicas=2
        into = host.alloc(2 * PAGE)
        assert store.batch_get_v1(keys, into) == [True, True]
        assert torch.equal(host.get_data_page(int(into[0])), host.get_data_page(int(slots[0])))
    finally:
        store.close()

    empty = kvpool("sglang-config", "--etcd", meta.endpoints[0], "--cluster", "nobody-here")
    assert empty.returncode == 1 and "no live pool nodes in cluster 'nobody-here'" in empty.stderr
