"""The router's decision on constructed inputs: where the cached prefix's bytes are, and the cost model.

``Router.route`` asks the pool (through its connector) which leading chunks are cached and on which tier; the
decision itself, :func:`decide`, is pure and is tested here without etcd or Ray.  The pool-backed path is
tested in tests/integration/prefill_decode/test_reuse.py.
"""

import pytest

from kvpool.prefill_decode.cost import Action, CostModel, Decision, Hardware, model_spec
from kvpool.prefill_decode.router import Route, decide

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
