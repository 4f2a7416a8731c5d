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

from engines import P, Q, R, S  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer random Llama (head size 64, as vLLM's CPU attention needs) saved where vLLM can load it offline."""
    from kvpool.prefill_decode.reference.model import tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-vllm")
    tiny_llama(layers=4, hidden=256, heads=4, kv_heads=2, vocab=4096, max_positions=4096).model.save_pretrained(path)
    return str(path)


@pytest.fixture
def pool_config(ray_cluster: list[str], etcd_server: EmbeddedEtcd) -> PoolConfig:
    """A pool's config on the session's Ray cluster, not started (for an engine that stops before it would reach it);
    leases of 30 s, so a killed holder's placements stay visible long enough for a test to ask for them."""
    metadata = MetadataConfig(endpoints=(etcd_server.endpoint,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=30)
    return PoolConfig(
        metadata=metadata, dram_bytes=64 * MiB, nvme_bytes=64 * MiB, namespace=f"vllm-{uuid.uuid4().hex[:8]}"
    )


@pytest.fixture
def engine_pool(pool_config: PoolConfig) -> Iterator[PoolConfig]:
    """``pool_config``'s pool, running on every node of the session's Ray cluster."""
    start_pool(pool_config)
    yield pool_config
    stop_pool(pool_config)


@pytest.fixture(scope="session")
def baseline(model_dir: str) -> dict[str, dict[str, Any]]:
    """What the model answers without vLLM or any connector: 8 greedy tokens of each prompt and their
    log-probabilities, computed by transformers from the saved weights (seconds, where an engine without the
    connector takes as long to start as any other)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return {name: _greedy(model, tokens) for name, tokens in zip("PRQS", [P, R, Q, S], strict=True)}


def _greedy(model: Any, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    import torch

    got: dict[str, Any] = {"tokens": [], "logprobs": []}
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            logprobs = torch.log_softmax(out.logits[0, -1], dim=-1)
            token = int(logprobs.argmax())
            got["tokens"].append(token)
            got["logprobs"].append(float(logprobs[token]))
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return got
