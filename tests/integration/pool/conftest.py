"""Fixtures of the pool tests: a pool (one PoolNode per node of the session's Ray cluster) per test module, emptied
between its tests.

Starting a pool costs seconds (three actors, their segments, NIXL agents and etcd records); emptying one costs a
remove call per node.  So a module's tests share one pool and each test gets it back as new: every chunk removed,
every node alive (a test that killed one gets a fresh pool).  What a test cannot get back from an emptied pool is
the nodes' cumulative counters (``kvpool_puts_total`` and the like): tests read those as differences.
"""

import uuid
from collections.abc import Iterator

import pytest

from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig, Watermarks
from kvpool.pool.node import start_pool, stop_pool
from kvpool.servers.etcd import EmbeddedEtcd

EMPTY_TIMEOUT_S = 60.0


def _new_pool(etcd_server: EmbeddedEtcd) -> PoolConfig:
    metadata = MetadataConfig(endpoints=(etcd_server.endpoint,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=2)
    config = PoolConfig(
        metadata=metadata,
        dram_bytes=4 * MiB,
        nvme_bytes=8 * MiB,
        watermarks=Watermarks(high=0.8, low=0.5),
        namespace=f"kvpool-{uuid.uuid4().hex[:8]}",
    )
    start_pool(config)
    return config


def _emptied(config: PoolConfig, node_ids: list[str]) -> bool:
    """Remove every chunk of the pool; False if a node is gone (the pool cannot be reused then)."""
    with PoolClient(config) as client:
        client.cache.sync()
        nodes = client.stats()["nodes"]  # every node asked: a killed one answers with an error
        if sorted(nodes) != sorted(node_ids) or any("error" in n for n in nodes.values()):
            return False
        client.remove_batch([key for key, _ in client.cache.chunks()])
        return client.cache.wait_until(lambda c: c.chunk_count() == 0, timeout_s=EMPTY_TIMEOUT_S)


@pytest.fixture(scope="module")
def _module_pool(ray_cluster: list[str], etcd_server: EmbeddedEtcd) -> Iterator[list[PoolConfig]]:
    """The module's pool, in a list so that a test that broke it can have it replaced."""
    holder = [_new_pool(etcd_server)]
    yield holder
    stop_pool(holder[0])


@pytest.fixture
def pool(_module_pool: list[PoolConfig], ray_cluster: list[str], etcd_server: EmbeddedEtcd) -> Iterator[PoolConfig]:
    """The module's pool, with no chunk in it and every node up: 4 MiB DRAM and 8 MiB NVMe a node."""
    yield _module_pool[0]
    if not _emptied(_module_pool[0], ray_cluster):
        stop_pool(_module_pool[0])
        _module_pool[0] = _new_pool(etcd_server)


@pytest.fixture
def client(pool: PoolConfig) -> Iterator[PoolClient]:
    with PoolClient(pool) as c:
        yield c
