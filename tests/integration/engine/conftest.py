"""Fixtures of the engine tests: a small random Llama saved for vLLM, a pool for the engines, engines in processes."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pools
import pytest
from engine_needed import vllm_module
from pools import PoolShelf

from kvpool.pool.config import PoolConfig
from kvpool.servers.etcd import EmbeddedEtcd

vllm_module()  # before engines, which imports vLLM

from engines import ENV, ZYGOTE, P, Q, R, S  # noqa: E402

from kvpool.prefill_decode.vllm.zygote import Zygote  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def zygote() -> Iterator[Zygote]:
    """One process that imported vLLM, forking the session's engines (~8 s of imports fewer per engine)."""
    with Zygote(ENV) as z:
        ZYGOTE.append(z)
        yield z
        ZYGOTE.clear()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer random Llama (head size 64, as vLLM's CPU attention needs) saved where vLLM can load it offline."""
    from kvpool.prefill_decode.reference.model import tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-vllm")
    tiny_llama(layers=4, hidden=256, heads=4, kv_heads=2, vocab=4096, max_positions=4096).model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama saved with SmolLM2's tokenizer (its vocabulary the tokenizer's), for the serving
    benches' tests (``vllm bench serve`` builds its prompts from text)."""
    from transformers import AutoTokenizer

    from kvpool.prefill_decode.reference.model import converted_smollm2, tiny_llama

    path = tmp_path_factory.mktemp("toy-serve-model")
    tokenizer = AutoTokenizer.from_pretrained(converted_smollm2(), local_files_only=True)
    tiny = tiny_llama(layers=4, hidden=256, heads=4, kv_heads=2, vocab=len(tokenizer), max_positions=4096)
    tiny.model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def pool_config(ray_cluster: list[str], etcd_server: EmbeddedEtcd) -> PoolConfig:
    """An engine pool's config on the session's Ray cluster, not started (for an engine that stops before it would
    reach it)."""
    return pools.engines(etcd_server.endpoint)


@pytest.fixture
def engine_pool(pool_shelf: PoolShelf) -> Iterator[PoolConfig]:
    """The session's engine pool (``tests/pools.py``: 64 MiB of DRAM and of NVMe a node), empty, every node up."""
    with pool_shelf.lend(pools.engines) as config:
        yield config


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
