"""Fixtures of the SGLang tests: a pool on the session's Ray cluster, and the extra config that points a backend at it
(SGLang's classes as the tests make them: hicache.py)."""

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hicache import CLASS, MODULE

from kvpool.metadata.config import MetadataConfig
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.servers.etcd import EmbeddedEtcd


@pytest.fixture
def sglang_pool(ray_cluster: list[str], etcd_server: EmbeddedEtcd) -> Iterator[PoolConfig]:
    """A pool on every node of the session's Ray cluster."""
    metadata = MetadataConfig(endpoints=(etcd_server.endpoint,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=30)
    config = PoolConfig(
        metadata=metadata, dram_bytes=64 * MiB, nvme_bytes=64 * MiB, namespace=f"sgl-{uuid.uuid4().hex[:8]}"
    )
    start_pool(config)
    yield config
    stop_pool(config)


@pytest.fixture
def extra(sglang_pool: PoolConfig) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` for a server using ``sglang_pool``."""
    return {
        "backend_name": "kvpool",
        "module_path": MODULE,
        "class_name": CLASS,
        "interface_v1": 1,
        "etcd": ",".join(sglang_pool.metadata.endpoints),
        "cluster": sglang_pool.metadata.cluster,
        "namespace": sglang_pool.namespace,
    }
