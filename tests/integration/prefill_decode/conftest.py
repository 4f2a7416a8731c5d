"""Fixtures of the prefill/decode tests: one pool per module on the session's Ray cluster, a small
random-weight Llama (8 layers, GQA)."""

import uuid
from collections.abc import Iterator

import pytest

from kvpool.metadata.config import MetadataConfig
from kvpool.pool.client import PoolClient
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.prefill_decode.reference.model import LoadedModel, tiny_llama
from kvpool.prefill_decode.reference.workers import WorkerConfig
from kvpool.prefill_decode.routing.cost import Hardware
from kvpool.servers.etcd import EmbeddedEtcd

MODEL_OPTIONS = (("layers", 8), ("hidden", 128), ("heads", 4), ("kv_heads", 2), ("vocab", 512))


@pytest.fixture(scope="module")
def pd_pool(request: pytest.FixtureRequest, ray_cluster: list[str], etcd_server: EmbeddedEtcd) -> Iterator[PoolConfig]:
    """A pool of ``POOL_MIB`` (a module's global, default 32) MiB of DRAM and of NVMe per node."""
    mib = getattr(request.module, "POOL_MIB", 32) * MiB
    metadata = MetadataConfig(endpoints=(etcd_server.endpoint,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=2)
    config = PoolConfig(metadata=metadata, dram_bytes=mib, nvme_bytes=mib, namespace=f"kvpool-{uuid.uuid4().hex[:8]}")
    start_pool(config)
    yield config
    stop_pool(config)


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
