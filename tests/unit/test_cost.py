"""The router's cost model: the reference analysis' numbers, the attention term, and the decision."""

from types import SimpleNamespace

import msgspec
import pytest

from kvpool.core.types import Tier
from kvpool.errors import ConfigError
from kvpool.prefill_decode.routing.cost import (
    KNOWN_MODELS,
    REFERENCE_HARDWARE,
    TIERS,
    Action,
    CostModel,
    Hardware,
    ModelSpec,
    model_spec,
)

L = 32_768


@pytest.fixture
def llama70() -> CostModel:
    return CostModel(model_spec("llama-3-70b"), REFERENCE_HARDWARE)


def test_reference_analysis_numbers(llama70: CostModel) -> None:
    """Llama-3-70B at 32,768 tokens on 400 TFLOPS: 11.47 s of prefill, 10.74 GB of KV, and per tier."""
    assert llama70.prefill_flops(L) == 2 * 70_000_000_000 * L
    assert llama70.prefill_s(L) == pytest.approx(11.47, rel=0.01)
    assert llama70.kv_bytes(L) == 10_737_418_240
    assert llama70.kv_bytes(L) / 1e9 == pytest.approx(10.74, rel=0.01)
    expected = {"dram": (0.168, 68.0), "nvme": (0.767, 15.0), "remote": (5.37, 2.1)}
    for tier, (reload_s, speedup) in expected.items():
        assert llama70.reload_s(L, tier) == pytest.approx(reload_s, rel=0.01)
        assert llama70.speedup(L, tier) == pytest.approx(speedup, rel=0.02)  # the analysis rounds 68.36 to 68


def test_break_even_rows(llama70: CostModel) -> None:
    rows = llama70.break_even(L)
    assert [r.tier for r in rows] == ["dram", "nvme", "remote"]
    assert [r.bandwidth for r in rows] == [64e9, 14e9, 2e9]
    for r in rows:
        assert r.kv_bytes == llama70.kv_bytes(L)
        assert r.prefill_s == llama70.prefill_s(L)
        assert r.reload_s == llama70.reload_s(L, r.tier)
        assert r.speedup == pytest.approx(r.prefill_s / r.reload_s)
        assert r.action is Action.RELOAD
    # reloading wins exactly above the break-even bandwidth
    assert llama70.break_even_bandwidth(L) == pytest.approx(llama70.kv_bytes(L) / 11.4688)


def test_break_even_only_lists_tiers_with_a_bandwidth() -> None:
    hw = Hardware(1e12, {"nvme": 5e9}, "measured on this cluster")
    rows = CostModel(model_spec("smollm2-135m"), hw).break_even(1024)
    assert [r.tier for r in rows] == ["nvme"]


@pytest.mark.parametrize(
    ("name", "per_token"),
    [
        ("llama-3-70b", 2 * 80 * 8 * 128 * 2),  # 327,680
        ("llama-3-8b", 2 * 32 * 8 * 128 * 2),  # 131,072
        ("smollm2-135m", 2 * 30 * 3 * 64 * 4),  # 46,080 (fp32)
    ],
)
def test_kv_bytes_per_token_of_known_models(name: str, per_token: int) -> None:
    assert model_spec(name).kv_bytes_per_token == per_token
    assert KNOWN_MODELS[name].name == name


def test_model_spec_lookup() -> None:
    assert model_spec("Llama-3-70B") is KNOWN_MODELS["llama-3-70b"]
    with pytest.raises(
        ConfigError, match=r"model must be one of llama-3-70b, llama-3-8b or smollm2-135m, got str 'gpt-9'"
    ):
        model_spec("gpt-9")
    with pytest.raises(ConfigError, match=r"model_spec: `name` expected `str`, got int 3"):
        model_spec(3)  # type: ignore[arg-type]


def test_from_hf_config() -> None:
    """SmolLM2-135M's config has no head_dim: hidden_size // num_attention_heads."""
    smol = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    spec = ModelSpec.from_hf_config(smol, name="smollm2-135m", params=134_515_008, kv_dtype_bytes=4)
    assert spec == KNOWN_MODELS["smollm2-135m"]
    llama = SimpleNamespace(
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_size=8192, head_dim=128
    )
    spec = ModelSpec.from_hf_config(llama, name="llama-3-70b", params=70_000_000_000, kv_dtype_bytes=2)
    assert spec == KNOWN_MODELS["llama-3-70b"]
    mha = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=None, hidden_size=64)
    assert ModelSpec.from_hf_config(mha, name="t", params=1, kv_dtype_bytes=2).kv_heads == 4
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ModelSpec.from_hf_config(
            SimpleNamespace(num_attention_heads=4, hidden_size=64), name="t", params=1, kv_dtype_bytes=2
        )


def test_attention_term() -> None:
    spec = model_spec("smollm2-135m")
    off = CostModel(spec, REFERENCE_HARDWARE)
    on = CostModel(spec, REFERENCE_HARDWARE, attention=True)
    assert off.prefill_flops(4096) == 2 * spec.params * 4096  # the reference analysis: no attention term
    assert off.prefill_flops(4096, 1000) == 2 * spec.params * 3096
    pairs = 4096 * 4097 // 2
    assert on.prefill_flops(4096) - off.prefill_flops(4096) == 4 * 30 * 9 * 64 * pairs
    for tokens, cached in [(4096, 0), (4096, 1), (4096, 1000), (4096, 4095), (4096, 4096), (1, 0), (7, 3)]:
        assert on.prefill_flops(tokens, cached) == on.prefill_flops(tokens) - on.prefill_flops(cached)
    assert on.prefill_flops(4096, 4096) == 0
    # on a small model at long context attention dominates
    assert on.prefill_flops(L) > 2 * off.prefill_flops(L)


def test_decide_reload_when_cheaper(llama70: CostModel) -> None:
    d = llama70.decide(L, 30_000, "nvme")
    assert d.action is Action.RELOAD and d.action.value == "reload"
    assert (d.prompt_tokens, d.cached_tokens, d.tier) == (L, 30_000, "nvme")
    assert d.reload_then_prefill_s == pytest.approx(llama70.reload_s(30_000, "nvme") + llama70.prefill_s(L, 30_000))
    assert d.recompute_s == llama70.prefill_s(L)
    assert d.saved_s == pytest.approx(d.recompute_s - d.reload_then_prefill_s)
    assert str(d).startswith("reload: 30000/32768 prompt tokens cached on nvme")
    assert llama70.decide(L, 30_000, Tier.NVME) == d


def test_decide_recompute_when_reload_is_slower() -> None:
    """SmolLM2 on 400 TFLOPS: prefill is so cheap that S3 at 2 GB/s loses, DRAM still wins."""
    model = CostModel(model_spec("smollm2-135m"), REFERENCE_HARDWARE, attention=True)
    d = model.decide(8192, 8000, "remote")
    assert d.action is Action.RECOMPUTE and d.reload_then_prefill_s > d.recompute_s
    assert str(d).startswith("recompute:")
    assert model.decide(8192, 8000, "dram").action is Action.RELOAD


def test_decide_with_nothing_cached_recomputes(llama70: CostModel) -> None:
    slow = CostModel(llama70.spec, Hardware(400e12, {"remote": 2e9}, "t"))
    d = slow.decide(L, 0, "dram")  # no dram bandwidth, but nothing to reload either
    assert d.action is Action.RECOMPUTE
    assert d.reload_then_prefill_s == d.recompute_s == slow.prefill_s(L)


def test_ties_recompute() -> None:
    """Equal predictions: recompute (no I/O).  One token: 2 B of KV at 2 B/s, 2·P = 2 FLOP at 2 FLOP/s."""
    spec = ModelSpec("tiny", params=1, layers=1, heads=1, kv_heads=1, head_dim=1, kv_dtype_bytes=1)
    model = CostModel(spec, Hardware(2, {"dram": 2}, "t"))
    assert model.reload_s(1, "dram") == model.prefill_s(1) == 1.0
    assert model.decide(1, 1, "dram").action is Action.RECOMPUTE
    assert model.break_even(1)[0].action is Action.RECOMPUTE


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", ""),
        ("params", 0),
        ("params", 70e9),
        ("layers", -1),
        ("heads", True),
        ("kv_heads", 0),
        ("kv_heads", 5),  # does not divide 64 heads
        ("head_dim", 1.5),
        ("kv_dtype_bytes", 3),
        ("kv_dtype_bytes", 2.0),
    ],
)
def test_invalid_model_spec(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        msgspec.structs.replace(KNOWN_MODELS["llama-3-70b"], **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, {"dram": 1e9}, "x"), "flops"),
        ((float("nan"), {"dram": 1e9}, "x"), "flops"),
        ((1e12, {"dram": -1.0}, "x"), "dram"),
        ((1e12, {"dram": float("inf")}, "x"), "dram"),
        ((1e12, {"gpu": 1e9}, "x"), "tier names"),
        ((1e12, [("dram", 1e9)], "x"), "bandwidth"),
        ((1e12, {"dram": 1e9}, ""), "source"),
    ],
)
def test_invalid_hardware(args: tuple[object, object, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Hardware(*args)  # type: ignore[arg-type]


def test_invalid_token_counts(llama70: CostModel) -> None:
    with pytest.raises(ConfigError, match="tokens"):
        llama70.prefill_s(-1)
    with pytest.raises(ConfigError, match="cached"):
        llama70.prefill_s(10, 11)
    with pytest.raises(ConfigError, match="tokens"):
        llama70.break_even(0)
    with pytest.raises(ConfigError, match="tier must be one of dram, nvme, remote or peer"):
        llama70.reload_s(10, "tape")
    with pytest.raises(ConfigError, match="no bandwidth for tier 'dram'"):
        CostModel(llama70.spec, Hardware(1e12, {"nvme": 1e9}, "t")).decide(10, 5, "dram")


def test_hardware_is_immutable_and_hashable() -> None:
    bw = {"remote": 2e9, "dram": 64e9, "nvme": 14e9}
    hw = Hardware(400e12, bw, "reference analysis")
    bw["dram"] = 1.0  # the caller's dict is copied
    assert hw == REFERENCE_HARDWARE and hash(hw) == hash(REFERENCE_HARDWARE)
    assert list(hw.bandwidth) == list(TIERS)  # canonical order, nearest first
    with pytest.raises(TypeError):
        hw.bandwidth["dram"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        hw.flops = 1.0  # type: ignore[misc]
    assert {hw, REFERENCE_HARDWARE} == {hw}
    assert hash(CostModel(model_spec("llama-3-8b"), hw)) == hash(CostModel(model_spec("llama-3-8b"), hw))


def test_with_overrides() -> None:
    assert REFERENCE_HARDWARE.with_overrides() is REFERENCE_HARDWARE
    assert REFERENCE_HARDWARE.with_overrides(dram=None) is REFERENCE_HARDWARE
    hw = REFERENCE_HARDWARE.with_overrides(flops=100e12, nvme=7e9)
    assert (hw.flops, dict(hw.bandwidth), hw.source) == (
        100e12,
        {"dram": 64e9, "nvme": 7e9, "remote": 2e9},
        "overridden",
    )
    assert REFERENCE_HARDWARE.bandwidth["nvme"] == 14e9  # the original is untouched
    added = Hardware(1e12, {"nvme": 1e9}, "measured on this cluster", 0.002, 0.02).with_overrides(dram=10e9)
    assert list(added.bandwidth) == ["dram", "nvme"]
    assert (added.latency_s, added.step_s) == (0.002, 0.02)  # measured fixed costs survive an override
    with pytest.raises(ConfigError, match="tier names"):
        REFERENCE_HARDWARE.with_overrides(tape=1e9)


def test_a_fixed_reload_latency_is_paid_once_per_reload() -> None:
    spec = model_spec("llama-3-8b")
    hw = Hardware(1e12, {"dram": 1e9}, "measured on this cluster", latency_s=0.01)
    model = CostModel(spec, hw)
    assert model.reload_s(0, "dram") == 0
    assert model.reload_s(1000, "dram") == pytest.approx(0.01 + 1000 * spec.kv_bytes_per_token / 1e9)
    assert model.transfer_s(1000, "dram") == pytest.approx(1000 * spec.kv_bytes_per_token / 1e9)
    assert hw.with_overrides(dram=2e9).latency_s == 0.01
    with pytest.raises(ConfigError, match="latency_s"):
        Hardware(1e12, {}, "t", latency_s=-1)
