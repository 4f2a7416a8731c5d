"""Fixtures of the SGLang tests: a pool on the session's Ray cluster, and the extra config that points a backend at it
(SGLang's classes as the tests make them: hicache.py)."""

from collections.abc import Iterator
from typing import Any

import pytest
from hicache import CLASS, MODULE
from pools import PoolShelf, engines

from kvpool.pool.config import PoolConfig


@pytest.fixture
def sglang_pool(pool_shelf: PoolShelf) -> Iterator[PoolConfig]:
    """The session's engine pool (``tests/pools.py``), empty, on every node of the session's Ray cluster."""
    with pool_shelf.lend(engines) as config:
        yield config


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
