"""Fixtures of the engine tests: a small random Llama saved for vLLM, a pool for the engines, engines in processes."""

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from engine_needed import vllm_module

from kvpool.metadata.config import MetadataConfig
from kvpool.pool.config import MiB, PoolConfig
from kvpool.pool.node import start_pool, stop_pool
from kvpool.servers.etcd import EmbeddedEtcd

vllm_module()  # before engines, which imports vLLM

from engines import P, Q, R, S, engine  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer random Llama (head size 64, as vLLM's CPU attention needs) saved where vLLM can load it offline."""
    from kvpool.prefill_decode.reference.model import tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-vllm")
    tiny_llama(layers=4, hidden=256, heads=4, kv_heads=2, vocab=4096, max_positions=4096).model.save_pretrained(path)
    return str(path)


@pytest.fixture
def engine_pool(ray_cluster: list[str], etcd_server: EmbeddedEtcd) -> Iterator[PoolConfig]:
    """A pool on every node of the session's Ray cluster; leases of 30 s, so a killed holder's placements stay
    visible long enough for a test to ask for them."""
    metadata = MetadataConfig(endpoints=(etcd_server.endpoint,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=30)
    config = PoolConfig(
        metadata=metadata, dram_bytes=64 * MiB, nvme_bytes=64 * MiB, namespace=f"vllm-{uuid.uuid4().hex[:8]}"
    )
    start_pool(config)
    yield config
    stop_pool(config)


@pytest.fixture(scope="module")
def baseline(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What the engine answers without any connector."""
    with engine({"model": model_dir}, tmp_path_factory.mktemp("engine") / "baseline.log") as e:
        got = e.generate([P, R, Q, S])
    return dict(zip("PRQS", got, strict=True))
