"""Tenants on a real pool: keys rooted in each tenant's secret (a lookup of another tenant's prompt hits nothing),
quotas enforced by the node that holds the chunks (the tenant's own oldest chunks go), per-tenant metrics and
``kvpool status --tenant``."""

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_metrics import scrape

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.misses import MissCause, miss_cause
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.pool.tenants import Tenants, new_secret

CHUNK = 256 * 1024
IDENTITY = CacheIdentity(model="tenants", kv_dtype="u8", layout="b", chunk_size=1)
KVPOOL = str(Path(sys.executable).with_name("kvpool"))


@pytest.fixture
def tenants() -> Tenants:
    return Tenants.parse(
        {
            "tenants": {
                "acme": {"secret": new_secret(), "dram_mib": 1, "nvme_mib": 2},
                "globex": {"secret": new_secret()},
            }
        }
    )


@pytest.fixture
def tenant_pool(ray_cluster: list[str], metadata_config: MetadataConfig, tenants: Tenants) -> Iterator[PoolConfig]:
    """One node (the driver's), 4 MiB DRAM + 8 MiB NVMe, with the tenants' quotas."""
    config = PoolConfig(
        metadata=metadata_config,
        dram_bytes=4 * MiB,
        nvme_bytes=8 * MiB,
        namespace=f"tenants-{uuid.uuid4().hex[:8]}",
        quotas=tenants.quotas(),
    )
    start_pool(config, ray_cluster[:1])
    yield config
    stop_pool(config)


def test_tenants_keys_quotas_and_metrics_on_a_real_pool(tenant_pool: PoolConfig, tenants: Tenants) -> None:
    prompt = range(16)
    acme = chunk_keys(IDENTITY, prompt, tenants.scope("acme"))
    globex = chunk_keys(IDENTITY, prompt, tenants.scope("globex"))
    blob = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    with PoolClient(tenant_pool) as client:
        client.put_batch([(k, blob) for k in acme[:4]], tenant="acme")
        assert client.lookup_prefix(acme) == 4
        assert client.lookup_prefix(globex) == 0  # the same prompt, another tenant: nothing to find
        client.put_batch([(k, blob) for k in globex[:4]], tenant="globex")
        client.put_batch([(k, blob) for k in acme[4:]], tenant="acme")  # 4 MiB for a quota of 1 + 2 MiB

        [me] = [n for n in client.cache.nodes() if n.node_id == client.node_id]
        used = ("kvpool_tenant_used_bytes", (("node", client.node_id), ("tenant", "acme"), ("tier", "dram")))
        deadline = time.monotonic() + 30  # DRAM over quota moves down on the node's background turn
        while scrape(me.metrics).get(used, 0) > MiB:
            assert time.monotonic() < deadline, "acme's DRAM never came down to its quota"
            time.sleep(0.1)
        metrics = scrape(me.metrics)
        node = (("node", client.node_id),)
        assert metrics[(used[0], (*node, ("tenant", "acme"), ("tier", "nvme")))] <= 2 * MiB
        assert metrics[("kvpool_tenant_quota_bytes", (*node, ("tenant", "acme"), ("tier", "dram")))] == MiB
        assert metrics[("kvpool_evictions_total", (*node, ("reason", "tenant_quota")))] >= 4
        assert metrics[(used[0], (*node, ("tenant", "globex"), ("tier", "dram")))] == 4 * CHUNK  # untouched

        # the node publishes an evicted chunk's removal after it counts it: on a loaded machine, later
        deadline = time.monotonic() + 30
        while sum(held := client.exists_batch(acme)) > 12:
            assert time.monotonic() < deadline, f"acme still holds {sum(held)} chunks, over its 3 MiB"
            time.sleep(0.1)
            client.cache.sync()
        assert all(held[-8:])  # its newest stayed, within 3 MiB
        assert not held[0] and miss_cause(client.cache, [acme[0]])[0] is MissCause.EVICTED
        assert all(client.exists_batch(globex[:4]))
        assert client.get(acme[-1]) == blob.tobytes()

        env = {**os.environ, "COLUMNS": "200"}
        shown = subprocess.run(
            [
                KVPOOL,
                "status",
                "--etcd",
                tenant_pool.metadata.endpoints[0],
                "--cluster",
                tenant_pool.metadata.cluster,
                "--tenant",
                "acme",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert shown.returncode == 0, shown.stderr
        assert "tenant 'acme'" in shown.stdout and "/ 1.0 MiB" in shown.stdout and "/ 2.0 MiB" in shown.stdout
