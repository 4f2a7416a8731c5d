"""Disaggregated prefill and decode as Ray actors on two different nodes, KV passing through the pool."""

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from kvpool.prefill_decode.model import LoadedModel
from kvpool.prefill_decode.workers import WorkerConfig, start_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers(ray_cluster: list[str], worker_config: WorkerConfig) -> Iterator[tuple[Any, Any]]:
    prefill, decode = start_workers(worker_config, ray_cluster[1], ray_cluster[2])
    yield prefill, decode
    for handle in (prefill, decode):
        ray.get(handle.close.remote())
        ray.kill(handle)


def test_decode_on_another_node_continues_from_the_pool(
    workers: tuple[Any, Any], model: LoadedModel, ray_cluster: list[str]
) -> None:
    prefill, decode = workers
    before = ray.get(prefill.stats.remote())  # the workers are the module's: other tests may have used them
    tokens = torch.randint(0, 512, (5 * 32 + 11,), generator=torch.Generator().manual_seed(11)).tolist()
    first = ray.get(prefill.prefill.remote(tokens))
    assert first.summary.action == "recompute" and first.summary.node_id == ray_cluster[1]
    assert first.saved_bytes > 0

    done = ray.get(decode.decode.remote(tokens, first.first_token, 10, revision=first.revision))
    with torch.no_grad():
        reference = model.model.generate(torch.tensor([tokens]), max_new_tokens=10, do_sample=False)
    assert done.tokens == reference[0, len(tokens) :].tolist()
    s = done.summary
    assert s.node_id == ray_cluster[2] and s.action == "reload" and not s.fell_back
    assert (s.reused_tokens, s.computed_tokens) == (5 * 32, 11)  # the partial last chunk is not pooled
    assert set(s.sources) == {f"dram@{ray_cluster[1][:12]}"}  # read one-sided from the prefill node

    again = ray.get(prefill.prefill.remote(tokens))  # the same prompt again: the prefix is reused
    assert again.first_token == first.first_token and again.summary.action == "reload"
    assert again.saved_bytes == 0 and again.summary.reused_tokens == 5 * 32
    after = ray.get(prefill.stats.remote())
    added = [after.get(k, 0) - before.get(k, 0) for k in ("requests", "reload", "recompute")]
    assert added == [2, 1, 1]


def test_http_completions_go_prefill_pool_decode(workers: tuple[Any, Any], model: LoadedModel) -> None:
    from aiohttp import ClientSession, web

    from kvpool.prefill_decode.service import Service, make_app

    tokens = torch.randint(0, 512, (3 * 32 + 4,), generator=torch.Generator().manual_seed(12)).tolist()
    service = Service(*workers, model=model.name)

    async def scenario() -> list[tuple[int, dict[str, Any]]]:
        runner = web.AppRunner(make_app(service))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        out = []
        try:
            async with ClientSession(f"http://127.0.0.1:{port}") as http:
                for body in (
                    {"model": model.name, "prompt": tokens, "max_tokens": 6},
                    {"model": model.name, "prompt": tokens, "max_tokens": 6},
                    {"prompt": "text needs a tokenizer", "max_tokens": 6},
                    {"prompt": tokens, "max_tokens": 0},
                    {"prompt": [*tokens, 9999], "max_tokens": 2},
                ):
                    async with http.post("/v1/completions", json=body) as r:
                        out.append((r.status, await r.json()))
                async with http.get("/stats") as r:
                    out.append((r.status, await r.json()))
        finally:
            await runner.cleanup()
        return out

    (s1, cold), (s2, warm), (s3, no_tok), (s4, bad), (s6, oov), (s5, stats) = asyncio.run(scenario())
    with torch.no_grad():
        reference = model.model.generate(torch.tensor([tokens]), max_new_tokens=6, do_sample=False)
    assert s1 == s2 == 200 and cold["choices"][0]["tokens"] == reference[0, len(tokens) :].tolist()
    assert warm["choices"][0]["tokens"] == cold["choices"][0]["tokens"]
    assert cold["usage"] == {"prompt_tokens": len(tokens), "completion_tokens": 6, "total_tokens": len(tokens) + 6}
    assert cold["kvpool"]["prefill"]["action"] == "recompute" and warm["kvpool"]["prefill"]["action"] == "reload"
    assert warm["kvpool"]["prefill"]["reused_tokens"] == 3 * 32
    assert s3 == 400 and "tokenizer" in no_tok["error"]["message"]
    assert s4 == 400 and "max_tokens" in bad["error"]["message"]
    assert s6 == 400 and "vocabulary" in oov["error"]["message"]  # the worker's ConfigError, as a 400
    assert s5 == 200 and stats["prefill"]["requests"] >= 2
