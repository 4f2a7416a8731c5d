"""Disaggregated prefill and decode as Ray actors on two different nodes, KV passing through the pool."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from http_asks import ask_app

from kvpool.prefill_decode.reference.model import LoadedModel
from kvpool.prefill_decode.reference.workers import WorkerConfig, start_lanes, start_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers(ray_cluster: list[str], worker_config: WorkerConfig) -> Iterator[tuple[Any, Any]]:
    prefill, decode = start_workers(worker_config, ray_cluster[1], ray_cluster[2])
    yield prefill, decode
    for handle in (prefill, decode):
        ray.get(handle.close.remote())
        ray.kill(handle)


def serve(service: Any, asks: list[tuple[str, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """``service``'s HTTP front asked ``asks`` (:func:`http_asks.ask_app`)."""
    from kvpool.prefill_decode.reference.service import make_app

    return ask_app(make_app(service), asks)


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
    from kvpool.prefill_decode.reference.service import Lane, Service

    tokens = torch.randint(0, 512, (3 * 32 + 4,), generator=torch.Generator().manual_seed(12)).tolist()
    service = Service(Lane(*workers), model=model.name)

    bodies = [
        {"model": model.name, "prompt": tokens, "max_tokens": 6},
        {"model": model.name, "prompt": tokens, "max_tokens": 6},
        {"prompt": "text needs a tokenizer", "max_tokens": 6},
        {"prompt": tokens, "max_tokens": 0},
        {"prompt": [*tokens, 9999], "max_tokens": 2},
    ]
    (s1, cold), (s2, warm), (s3, no_tok), (s4, bad), (s6, oov), (s5, stats) = serve(service, [("", b) for b in bodies])
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
    assert s5 == 200 and stats["lanes"][0]["prefill"]["requests"] >= 2 and stats["router"] is None


def test_two_lanes_route_to_the_prefix(
    workers: tuple[Any, Any], worker_config: WorkerConfig, model: LoadedModel, ray_cluster: list[str]
) -> None:
    """A second lane (prefill on node 2, decode on node 1) beside the module's: cache-aware routing sends a
    prompt seen before to the lane whose node holds its prefix in DRAM; round-robin alternates whatever it
    costs; both lanes answer as recomputing would."""
    from kvpool.metadata.cache import MetadataCache
    from kvpool.metadata.client import EtcdClient
    from kvpool.metadata.namespace import Namespace
    from kvpool.prefill_decode.reference.service import Lane, Service, lane_router

    ((prefill2, decode2),) = start_lanes(worker_config, [(ray_cluster[2], ray_cluster[1])])
    lanes = [Lane(*workers), Lane(prefill2, decode2)]
    etcd = EtcdClient(worker_config.pool.metadata)
    cache = MetadataCache(etcd, Namespace(worker_config.pool.metadata.cluster)).start()
    try:
        aware = Service(lanes, model=model.name, router=lane_router(lanes, cache.replicas, "cache-aware"))
        robin = Service(lanes, model=model.name, router=lane_router(lanes, cache.replicas, "round-robin"))
        tokens = torch.randint(0, 512, (4 * 32 + 5,), generator=torch.Generator().manual_seed(13)).tolist()
        cold = aware.complete_sync(tokens, 4)
        assert cold.quote is not None and cold.quote.decision.cached_tokens == 0
        holder = ray_cluster[1 + cold.lane]  # lane i's prefill worker runs on node i + 1 and put the chunks there
        cache.wait_until(lambda c: c.revision >= cold.prefill.revision, timeout_s=10)
        warm = aware.complete_sync(tokens, 4)
        assert warm.lane == cold.lane and warm.quote is not None
        assert (warm.quote.decision.tier, warm.quote.decision.cached_tokens) == ("dram", 4 * 32)
        assert warm.prefill.summary.node_id == holder and warm.prefill.summary.reused_tokens == 4 * 32
        assert aware.router is not None and aware.router.stats()["hit_rate"] == pytest.approx(4 * 32 / 2 / len(tokens))

        lanes_used = [robin.complete_sync(tokens, 4) for _ in range(2)]
        assert sorted(d.lane for d in lanes_used) == [0, 1]
        other = next(d for d in lanes_used if d.lane != cold.lane)
        assert other.quote is not None and other.quote.decision.tier == "peer"  # priced as a network read
        with torch.no_grad():
            reference = model.model.generate(torch.tensor([tokens]), max_new_tokens=4, do_sample=False)
        for done in (cold, warm, *lanes_used):
            assert done.tokens == reference[0, len(tokens) :].tolist()
    finally:
        cache.close()
        etcd.close()
        for handle in (prefill2, decode2):
            ray.get(handle.close.remote())
            ray.kill(handle)


def test_a_tenant_never_hits_another_tenants_prefix(
    workers: tuple[Any, Any], model: LoadedModel, tmp_path: Path
) -> None:
    """Through the HTTP front with a tenants file: the key a request carries decides whose chain its chunks are keyed
    in.  Another tenant's prompt, sent word for word, hits nothing (the probe learns nothing); a shared namespace is
    shared by the tenants that list it; a request without a tenant's key is refused; every answer is the model's."""
    from kvpool.pool.tenants import Tenants, new_secret
    from kvpool.prefill_decode.reference.service import Lane, Service

    path = tmp_path / "tenants.toml"
    path.write_text(
        f"[tenants.acme]\nsecret = '{new_secret()}'\napi_keys = ['sk-acme']\nshared = ['public']\n"
        f"[tenants.globex]\nsecret = '{new_secret()}'\napi_keys = ['sk-globex']\nshared = ['public']\n"
        f"[shared.public]\nsecret = '{new_secret()}'\n"
    )
    service = Service(Lane(*workers), model=model.name, tenants=Tenants.load(str(path)))
    tokens = torch.randint(0, 512, (3 * 32 + 4,), generator=torch.Generator().manual_seed(14)).tolist()
    body = {"prompt": tokens, "max_tokens": 4}
    asks = [
        ("sk-acme", body),
        ("sk-acme", body),  # cold, then its own prefix
        ("sk-globex", body),
        ("sk-globex", body),  # the same prompt: acme's chunks are not its; then its own
        ("sk-acme", {**body, "cache_namespace": "public"}),
        ("sk-globex", {**body, "cache_namespace": "public"}),
        ("", body),
        ("sk-nobody", body),
        ("sk-acme", {**body, "cache_namespace": "secret-club"}),
    ]

    *got, (_, stats) = serve(service, asks)
    reused = [answer["kvpool"]["prefill"]["reused_tokens"] for status, answer in got[:6]]
    assert [status for status, _ in got] == [200] * 6 + [401, 401, 403]
    assert reused == [0, 3 * 32, 0, 3 * 32, 0, 3 * 32]
    with torch.no_grad():
        reference = model.model.generate(torch.tensor([tokens]), max_new_tokens=4, do_sample=False)
    assert all(answer["choices"][0]["tokens"] == reference[0, len(tokens) :].tolist() for _, answer in got[:6])
    assert "Authorization: Bearer" in got[6][1]["error"]["message"]
    assert "may not use shared namespace 'secret-club'" in got[8][1]["error"]["message"]
    per_tenant = {t: (c["requests"], c["reused_tokens"]) for t, c in stats["tenants"].items()}
    assert per_tenant == {"acme": (3, 3 * 32), "globex": (3, 2 * 3 * 32)}  # refused requests count for nobody
