"""The router's decision on constructed inputs: where the cached prefix's bytes are, and the cost model.

``Router.route`` asks the pool (through its connector) which leading chunks are cached and on which tier; the
decision itself, :func:`decide`, is pure and is tested here without etcd or Ray.  The pool-backed path is
tested in tests/integration/prefill_decode/test_reuse.py.
"""

from collections.abc import Callable, Sequence

import pytest

from kvpool.core.types import Placement, Tier
from kvpool.errors import ConfigError
from kvpool.pool.tenants import Scope
from kvpool.prefill_decode.routing.cost import Action, CostModel, Decision, Hardware, model_spec
from kvpool.prefill_decode.routing.router import PEER, LaneRouter, Policy, Quote, Route, choose, decide, read_path

L = 32_768


@pytest.fixture
def llama70() -> CostModel:
    """Llama-3-70B on the reference hardware, with a fixed reload latency so that it shows in the sums."""
    hardware = Hardware(400e12, {"dram": 64e9, "nvme": 14e9, "remote": 2e9}, "test", latency_s=0.01)
    return CostModel(model_spec("llama-3-70b"), hardware)


def test_nothing_cached_recomputes(llama70: CostModel) -> None:
    for by_tier in ({}, {"dram": 1 << 20}):
        d = decide(llama70, L, 0, by_tier)
        assert d.action is Action.RECOMPUTE
        assert (d.prompt_tokens, d.cached_tokens, d.tier) == (L, 0, "-")
        assert d.reload_then_prefill_s == d.recompute_s == llama70.prefill_s(L)


def test_one_tier_matches_the_cost_model(llama70: CostModel) -> None:
    """With every byte on one tier the router prices the reload as ``CostModel.decide`` does."""
    for tier in ("dram", "nvme", "remote"):
        d = decide(llama70, L, 30_000, {tier: 123_456})
        assert d == llama70.decide(L, 30_000, tier)
        assert d.action is Action.RELOAD


def test_prefix_split_across_tiers_by_bytes(llama70: CostModel) -> None:
    """Three quarters of the bytes in DRAM, one in NVMe: the prefix's tokens are shared out the same way."""
    d = decide(llama70, L, 16_384, {"nvme": 1_000, "dram": 3_000})
    expected = (
        llama70.hardware.latency_s
        + llama70.transfer_s(12_288, "dram")
        + llama70.transfer_s(4_096, "nvme")
        + llama70.prefill_s(L, 16_384)
    )
    assert d.reload_then_prefill_s == pytest.approx(expected)
    assert d.tier == "dram+nvme"  # sorted, whatever order the bytes came in
    assert d.action is Action.RELOAD


def test_whole_prompt_cached_still_computes_the_last_token(llama70: CostModel) -> None:
    d = decide(llama70, 4096, 4096, {"dram": 1})
    assert d.cached_tokens == 4096
    expected = llama70.hardware.latency_s + llama70.transfer_s(4096, "dram") + llama70.prefill_s(4096, 4095)
    assert d.reload_then_prefill_s == pytest.approx(expected)
    assert llama70.prefill_s(4096, 4095) > 0


def test_slow_pool_recomputes() -> None:
    slow = CostModel(model_spec("llama-3-70b"), Hardware(1e15, {"dram": 1.0}, "slow pool"))
    d = decide(slow, L, 30_000, {"dram": 1})
    assert d.action is Action.RECOMPUTE
    assert d.cached_tokens == 30_000 and d.tier == "dram"
    assert d.reload_then_prefill_s > d.recompute_s


def test_unmeasured_tier_is_priced_at_the_slowest_known() -> None:
    """A chunk on another node's NVMe, where this node measured only DRAM and S3: priced at S3's bandwidth."""
    cost = CostModel(model_spec("llama-3-70b"), Hardware(400e12, {"dram": 64e9, "remote": 2e9}, "no nvme here"))
    d = decide(cost, L, 30_000, {"nvme": 1})
    assert d.reload_then_prefill_s == pytest.approx(cost.kv_bytes(30_000) / 2e9 + cost.prefill_s(L, 30_000))
    assert d.tier == "nvme"


def test_no_bandwidth_at_all_never_reloads() -> None:
    cost = CostModel(model_spec("llama-3-70b"), Hardware(400e12, {}, "nothing measured"))
    d = decide(cost, L, 30_000, {"dram": 1})
    assert d.action is Action.RECOMPUTE
    assert d.reload_then_prefill_s == float("inf")


def test_route_reuses_cached_chunks_only_on_reload() -> None:
    keys = [[b"k%d" % i] for i in range(4)]
    reload = Decision(Action.RELOAD, 1024, 768, "dram", 0.1, 1.0)
    recompute = Decision(Action.RECOMPUTE, 1024, 768, "dram", 1.0, 0.1)
    assert Route(reload, keys, 3).reuse_chunks == 3
    assert Route(recompute, keys, 3).reuse_chunks == 0


# -- lanes: which prefill worker serves a request --------------------------------------------------------

NODES = ["node-a", "node-b", "node-c"]
CHUNK = 256


def _placements(where: dict[bytes, list[tuple[str, Tier]]]) -> Callable[[bytes], list[Placement]]:
    table = {k: [Placement(k, node, tier, 0, 1 << 20, 1 << 20, 0) for node, tier in v] for k, v in where.items()}
    return lambda key: table.get(key, [])


def _keys(tokens: Sequence[int], scope: Scope | None = None) -> list[list[bytes]]:
    """Chunk c of a prompt is one object named by the prompt's first token and c (a stand-in for the hash chain);
    a tenant's scope (its name stands for its secret) gives other names."""
    tag = b"" if scope is None else scope.tenant.encode()
    return [[b"%s%d-%d" % (tag, tokens[0], c)] for c in range(len(tokens) // CHUNK)]


def _router(where: dict[bytes, list[tuple[str, Tier]]], policy: Policy) -> LaneRouter:
    hardware = Hardware(1e12, {"dram": 20e9, "nvme": 2e9, "peer": 4e9}, "test", latency_s=0.001)
    cost = CostModel(model_spec("llama-3-8b"), hardware)
    return LaneRouter(NODES, [cost] * 3, _keys, CHUNK, _placements(where), policy)


def _quote(lane: int, queued: int, queued_s: float, prefill_s: float) -> Quote:
    return Quote(lane, Decision(Action.RECOMPUTE, 1024, 0, "-", prefill_s, prefill_s), queued, queued_s)


def test_a_tenants_prompt_is_quoted_in_its_own_chain() -> None:
    """What is cached for one chain is no prediction for another: a tenant's quote of a prompt cached for nobody in
    particular (or for another tenant) counts nothing cached, and the booked chunks are the tenant's own."""
    prompt = [7] * (2 * CHUNK)
    where = {b"7-%d" % c: [("node-b", Tier.DRAM)] for c in range(2)}
    router = _router(where, Policy.CACHE_AWARE)
    acme = Scope("tenant:acme", "acme", b"s" * 16)
    assert all(q.decision.cached_tokens == 0 for q in router.quotes(prompt, acme))
    assert router.pick(prompt, acme).keys == (b"acme7-0", b"acme7-1")
    assert router.quotes(prompt)[1].decision.cached_tokens == 2 * CHUNK


def test_read_path_is_the_tier_on_the_readers_node_and_peer_for_another_nodes_dram() -> None:
    assert read_path("dram", "a", "a") == "dram" and read_path("nvme", "a", "a") == "nvme"
    assert read_path("dram", "b", "a") == PEER
    assert read_path("nvme", "b", "a") == "nvme"  # another node's disk: priced at the disk
    assert read_path("remote", "s3", "a") == "remote"


def test_cache_aware_goes_where_the_prefix_is_in_dram() -> None:
    prompt = [7] * (4 * CHUNK)
    where = {b"7-%d" % c: [("node-b", Tier.DRAM), ("node-c", Tier.NVME)] for c in range(4)}
    router = _router(where, Policy.CACHE_AWARE)
    quotes = router.quotes(prompt)
    assert [q.decision.tier for q in quotes] == ["peer", "dram", "nvme"]  # a: b's DRAM over the network
    assert all(q.decision.cached_tokens == 4 * CHUNK for q in quotes)
    assert quotes[1].ttft_s < quotes[0].ttft_s < quotes[2].ttft_s
    assert router.pick(prompt).lane == 1


def test_cache_aware_weighs_the_queue_against_the_prefix() -> None:
    """The lane holding the prefix is chosen until the work queued on it costs more than recomputing elsewhere."""
    prompt = [7] * (8 * CHUNK)
    router = _router({b"7-%d" % c: [("node-b", Tier.DRAM)] for c in range(8)}, Policy.CACHE_AWARE)
    recompute_s = router.costs[0].prefill_s(len(prompt))
    picks = [router.pick(prompt) for _ in range(50)]  # none released: the queue on the chosen lane grows
    assert picks[0].lane == 1 and picks[1].lane == 1
    first_elsewhere = next(q for q in picks if q.lane != 1)
    assert first_elsewhere.ttft_s <= sum(q.prefill_s for q in picks if q.lane == 1) + recompute_s
    for q in picks:
        router.release(q)
    assert router.stats()["lanes"] == [
        {"node": n, "requests": c, "queued": 0}
        for n, c in zip(NODES, [sum(q.lane == i for q in picks) for i in range(3)], strict=True)
    ]


def test_nothing_cached_spreads_the_work() -> None:
    router = _router({}, Policy.CACHE_AWARE)
    picks = [router.pick([i] * CHUNK).lane for i in range(6)]  # equal predictions: the queue decides
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_a_prefix_with_a_hole_counts_up_to_the_hole() -> None:
    where = {b"7-0": [("node-a", Tier.DRAM)], b"7-2": [("node-a", Tier.DRAM)]}
    quotes = _router(where, Policy.CACHE_AWARE).quotes([7] * (3 * CHUNK))
    assert {q.decision.cached_tokens for q in quotes} == {CHUNK}


def test_baselines() -> None:
    quotes = [_quote(0, 2, 2.0, 0.1), _quote(1, 0, 0.0, 9.0), _quote(2, 1, 0.5, 0.1)]
    assert [choose(Policy.ROUND_ROBIN, quotes, t).lane for t in range(4)] == [0, 1, 2, 0]
    assert choose(Policy.LEAST_LOADED, quotes, 0).lane == 1
    assert choose(Policy.CACHE_AWARE, quotes, 0).lane == 2  # 0.5 + 0.1 s beats 9 s and 2.1 s
    tied = [_quote(i, 0, 0.0, 1.0) for i in range(3)]
    assert [choose(Policy.LEAST_LOADED, tied, t).lane for t in range(3)] == [0, 1, 2]
    assert [choose(Policy.CACHE_AWARE, tied, t).lane for t in range(3)] == [0, 1, 2]


def test_policy_names() -> None:
    assert Policy.of("least-loaded") is Policy.LEAST_LOADED
    with pytest.raises(ConfigError, match="cache-aware, least-loaded, round-robin"):
        Policy.of("fastest")
    with pytest.raises(ConfigError, match="at least one prefill worker"):
        choose(Policy.CACHE_AWARE, [], 0)
    with pytest.raises(ConfigError, match="one cost model per lane"):
        LaneRouter(NODES, [], _keys, CHUNK, _placements({}))


def test_a_prefix_in_flight_on_a_lane_counts_as_cached_there() -> None:
    """A prompt sent to a lane and not back yet will be in that node's DRAM when the lane gets to the next request:
    the same prompt again is quoted as a hit there (after the queue), a miss elsewhere; until it is released."""
    router = _router({}, Policy.CACHE_AWARE)
    prompt = [9] * (8 * CHUNK)
    first = router.pick(prompt)
    assert first.lane == 0 and first.decision.cached_tokens == 0
    busy = [router.pick([i] * (8 * CHUNK)) for i in (1, 2)]  # the other lanes get as much work
    assert [q.lane for q in busy] == [1, 2]
    quotes = router.quotes(prompt)
    assert [q.decision.cached_tokens for q in quotes] == [8 * CHUNK, 0, 0]
    assert quotes[0].decision.tier == "dram" and quotes[0].ttft_s < min(q.ttft_s for q in quotes[1:])
    again = router.pick(prompt)
    assert again.lane == 0
    for q in (first, *busy, again):
        router.release(q)
    assert [q.decision.cached_tokens for q in router.quotes(prompt)] == [0, 0, 0]  # nothing was put, after all
