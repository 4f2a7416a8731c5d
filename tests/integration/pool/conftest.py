"""Fixtures of the pool tests: the session's small pool (``tests/pools.py``), emptied between tests."""

from collections.abc import Iterator

import pytest
from pools import PoolShelf, small

from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig


@pytest.fixture
def pool(pool_shelf: PoolShelf) -> Iterator[PoolConfig]:
    """The session's small pool, with no chunk in it and every node up: 4 MiB DRAM and 8 MiB NVMe a node."""
    with pool_shelf.lend(small) as config:
        yield config


@pytest.fixture
def client(pool: PoolConfig) -> Iterator[PoolClient]:
    with PoolClient(pool) as c:
        yield c
