"""Fixtures of the prefill/decode tests: a pool lent to each module by the session's shelf, a small random-weight
Llama (8 layers, GQA)."""

from collections.abc import Iterator

import pytest
from pools import PoolShelf, both_tiers

from kvpool.pool.client import PoolClient
from kvpool.pool.config import PoolConfig
from kvpool.prefill_decode.reference.model import LoadedModel, tiny_llama
from kvpool.prefill_decode.reference.workers import WorkerConfig
from kvpool.prefill_decode.routing.cost import Hardware

MODEL_OPTIONS = (("layers", 8), ("hidden", 128), ("heads", 4), ("kv_heads", 2), ("vocab", 512))


@pytest.fixture(scope="module")
def pd_pool(request: pytest.FixtureRequest, pool_shelf: PoolShelf) -> Iterator[PoolConfig]:
    """The session's pool of ``POOL_MIB`` (a module's global, default 32) MiB of DRAM and of NVMe per node
    (``tests/pools.py``), lent to the module empty."""
    with pool_shelf.lend(both_tiers(getattr(request.module, "POOL_MIB", 32))) as config:
        yield config


@pytest.fixture(scope="module")
def pd_client(pd_pool: PoolConfig) -> Iterator[PoolClient]:
    with PoolClient(pd_pool) as c:
        yield c


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_llama(seed=0, **dict(MODEL_OPTIONS))


@pytest.fixture(scope="module")
def worker_config(pd_pool: PoolConfig) -> WorkerConfig:
    """Workers on the module's pool with the test model, 32-token chunks and fixed cost-model figures."""
    return WorkerConfig(
        pool=pd_pool,
        model="tiny-llama",
        model_options=MODEL_OPTIONS,
        chunk_size=32,
        hardware=Hardware(5e9, {"dram": 1e9, "nvme": 2e8}, "fixed for tests"),
        torch_threads=1,
    )
