"""KV through the pool and back into a real model: bytes bit for bit, tokens equal to recomputing,
partial hits prefill only the suffix, a lost chunk falls back to recompute."""

from collections.abc import Iterator

import pytest
import torch

from kvpool.pool.client import PoolClient
from kvpool.prefill_decode.reference.calibrate import spec_of
from kvpool.prefill_decode.reference.connector import PoolConnector
from kvpool.prefill_decode.reference.layout import KVLayout
from kvpool.prefill_decode.reference.model import LoadedModel
from kvpool.prefill_decode.reference.reload import Router
from kvpool.prefill_decode.reference.runner import ModelRunner
from kvpool.prefill_decode.routing.cost import Action, CostModel, Hardware

CHUNK = 32  #: short chunks keep the prompts short
#: fixed figures: routing in tests must not depend on how fast this machine is right now
HARDWARE = Hardware(5e9, {"dram": 1e9, "nvme": 2e8}, "fixed for tests")


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(model: LoadedModel, tokens: list[int], n: int) -> list[int]:
    """The reference: transformers' own greedy generate(), no pool involved."""
    with torch.no_grad():
        out = model.model.generate(
            torch.tensor([tokens]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[0, len(tokens) :].tolist()


@pytest.fixture(params=["per-layer", "all-layers", "groups-of-4"])
def stack(request: pytest.FixtureRequest, model: LoadedModel, pd_client: PoolClient) -> Iterator[tuple]:
    layout = KVLayout.of(model.model, chunk_size=CHUNK, layout=request.param)
    connector = PoolConnector(pd_client, layout, layout.identity(model.name))
    router = Router(connector, CostModel(spec_of(model), HARDWARE, attention=True))
    yield ModelRunner(model, connector), router
    connector.close()


def test_kv_round_trips_bit_for_bit(stack: tuple, model: LoadedModel) -> None:
    runner, router = stack
    tokens = prompt(1, 3 * CHUNK + 5)
    route = router.route(tokens)
    assert route.cached_chunks == 0 and route.decision.action is Action.RECOMPUTE
    pre = runner.prefill(tokens)
    assert runner.save(pre, route.keys) == 3 * CHUNK * runner.connector.layout.token_bytes
    saved = [p for ks in route.keys[:3] for k in ks for p in runner.connector.client.cache.replicas(k)]
    assert {p.identity for p in saved} == {runner.connector.fingerprint}  # what the chunk events will report

    again = router.route(tokens)
    assert again.cached_chunks == 3 and again.decision.action is Action.RELOAD
    runner.connector.load(again.keys, 3).finish()
    # the reused load buffer, every byte 0xff (NaN in any float dtype): only a real fetch can refill it
    runner.connector.staging.get(runner.connector.client, 0).fill_(0xFF)
    loading = runner.connector.load(again.keys, 3)
    loading.finish()
    for layer in range(model.model.config.num_hidden_layers):
        k, v = loading.cache.layers[layer].keys, loading.cache.layers[layer].values
        assert torch.equal(k, pre.cache.layers[layer].keys[..., : 3 * CHUNK, :])
        assert torch.equal(v, pre.cache.layers[layer].values[..., : 3 * CHUNK, :])


def test_reused_kv_gives_the_tokens_of_recomputing(stack: tuple, model: LoadedModel) -> None:
    runner, router = stack
    tokens = prompt(2, 4 * CHUNK)  # every chunk hits: the last token is recomputed for its logits
    pre = runner.prefill(tokens)
    runner.save(pre, router.route(tokens).keys)

    route = router.route(tokens)
    warm = runner.prefill(tokens, route.keys, route.reuse_chunks)
    assert (warm.reused_tokens, warm.computed_tokens, warm.fell_back) == (4 * CHUNK - 1, 1, False)
    assert runner.decode(warm, 12) == generate(model, tokens, 12)


def test_partial_hit_prefills_only_the_suffix(stack: tuple, model: LoadedModel) -> None:
    runner, router = stack
    shared = prompt(3, 2 * CHUNK)
    first, second = shared + prompt(4, CHUNK + 7), shared + prompt(5, 2 * CHUNK + 3)
    runner.save(runner.prefill(first), router.route(first).keys)

    route = router.route(second)
    assert route.cached_chunks == 2 and route.reuse_chunks == 2
    warm = runner.prefill(second, route.keys, route.reuse_chunks)
    assert warm.computed_tokens == len(second) - 2 * CHUNK
    cold = runner.prefill(second)
    torch.testing.assert_close(warm.logits, cold.logits, rtol=0, atol=1e-5)
    assert runner.decode(warm, 10) == generate(model, second, 10)


def test_a_chunk_lost_mid_request_falls_back_to_recompute(stack: tuple, model: LoadedModel) -> None:
    runner, router = stack
    tokens = prompt(6, 3 * CHUNK + 9)
    runner.save(runner.prefill(tokens), router.route(tokens).keys)
    route = router.route(tokens)
    assert route.reuse_chunks == 3
    runner.connector.client.remove(route.keys[2][-1])  # gone after the router looked: a node died, say
    stats = runner.connector.client._stats
    stats.report(force=True)
    node, stats.node = stats.node, lambda: None  # hold the counts here (not handed to the node) to read them
    try:
        pre = runner.prefill(tokens, route.keys, route.reuse_chunks)
        assert router.route(tokens).cached_chunks == 2
        assert stats.seen.misses == {"read_failed": 1, "removed": 1}  # kvpool_misses_total{cause=...}
    finally:
        stats.node = node
    assert pre.fell_back and pre.reused_tokens == 0 and pre.computed_tokens == len(tokens)
    assert runner.decode(pre, 8) == generate(model, tokens, 8)


def test_router_recomputes_when_reloading_is_slower(stack: tuple, model: LoadedModel) -> None:
    runner, router = stack
    tokens = prompt(7, 2 * CHUNK)
    runner.save(runner.prefill(tokens), router.route(tokens).keys)
    slow = Router(runner.connector, CostModel(spec_of(model), Hardware(1e15, {"dram": 1.0}, "slow pool")))
    route = slow.route(tokens)
    assert route.cached_chunks == 2 and route.decision.action is Action.RECOMPUTE and route.reuse_chunks == 0
    assert slow.stats()["recompute"] == 1 and slow.stats()["hit_rate"] == 1.0
    assert "recompute" in str(route.decision) and route.sources  # the prefix is there; it was judged too slow


def test_a_tier_without_a_figure_is_priced_at_the_slowest_known(stack: tuple, model: LoadedModel) -> None:
    runner, _ = stack
    tokens = prompt(8, 2 * CHUNK)
    router = Router(runner.connector, CostModel(spec_of(model), Hardware(5e9, {"nvme": 2e8}, "no dram figure")))
    runner.save(runner.prefill(tokens), router.route(tokens).keys)
    route = router.route(tokens)  # the chunks are in DRAM, priced at NVMe's bandwidth: still worth reloading
    assert route.cached_chunks == 2 and route.decision.action is Action.RELOAD
