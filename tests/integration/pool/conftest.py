"""Fixtures of the pool tests: a fresh pool (one PoolNode per node of the session's Ray cluster) per test."""

import uuid
from collections.abc import Iterator

import pytest

from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig, Watermarks
from kvpool.pool.node import start_pool, stop_pool


@pytest.fixture
def pool(ray_cluster: list[str], metadata_config: MetadataConfig) -> Iterator[PoolConfig]:
    config = PoolConfig(
        metadata=metadata_config,
        dram_bytes=4 * MiB,
        nvme_bytes=8 * MiB,
        watermarks=Watermarks(high=0.8, low=0.5),
        namespace=f"kvpool-{uuid.uuid4().hex[:8]}",
    )
    start_pool(config)
    yield config
    stop_pool(config)


@pytest.fixture
def client(pool: PoolConfig) -> Iterator[PoolClient]:
    with PoolClient(pool) as c:
        yield c
