"""The router's cost model: reload a cached KV prefix from the pool, or recompute it?

Recomputing ``S`` tokens of prefill costs ``T_prefill ≈ 2·P·S / FLOPS_eff`` (plus, optionally, the causal
attention term the design's reference analysis leaves out); reloading the KV of ``L`` cached tokens from a
tier costs ``T_reload = Size_KV(L) / BW_tier``.  For a request whose first ``c`` prompt tokens are cached,
reloading wins when ``T_reload(c) + T_prefill(c → L) < T_prefill(0 → L)``.

Pure arithmetic: no I/O, no torch.  Rendering is the CLI's (``kvpool plan``); measuring ``FLOPS_eff`` and the
tiers' bandwidth on a cluster is done elsewhere and handed in as a :class:`Hardware`.
"""

import enum
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvpool.core.config import Config, Positive, checked, one_of, validated
from kvpool.core.types import Tier
from kvpool.errors import ConfigError

#: The tiers a KV prefix can be reloaded from, nearest first (the pool's :class:`Tier` names, GPU excepted).
TIERS: tuple[str, ...] = tuple(t.value for t in Tier if t is not Tier.GPU)
#: What a reload can be priced at: the tiers, and ``peer`` — a DRAM replica on another node, read over the network.
PATHS: tuple[str, ...] = (*TIERS, "peer")
_Path = Annotated[str, Meta(pattern=rf"^({'|'.join(PATHS)})\Z")]
_BANDWIDTH = f"a map of tier names ({', '.join(PATHS)}) to bytes/s, finite numbers > 0"
_PositiveFinite = Annotated[float, Meta(gt=0, le=sys.float_info.max, description="a finite number > 0")]
KvDtypeBytes = Annotated[Literal[1, 2, 4], Meta(description="1, 2 or 4 (bytes per KV element)")]
_NonNegativeFinite = Annotated[float, Meta(ge=0, le=sys.float_info.max, description="a finite number >= 0")]


Tokens = Annotated[int, Meta(ge=0, description="a number of tokens: an int >= 0")]
SomeTokens = Annotated[int, Meta(ge=1, description="a number of tokens: an int >= 1")]


def _tier_name(tier: str | Tier) -> str:
    """``tier``'s name, one of :data:`PATHS`."""
    return one_of(PATHS, tier.value if isinstance(tier, Tier) else tier, "tier")


class ModelSpec(Config, frozen=True):
    """What the cost model needs to know about a model: its size and the shape of its KV cache."""

    name: Annotated[str, Meta(min_length=1)]
    params: Positive  #: total parameter count, the ``P`` of ``2·P`` FLOPs per token
    layers: Positive
    heads: Positive  #: query heads (the attention FLOPs scale with these)
    kv_heads: Positive  #: key/value heads (the KV size scales with these; fewer than ``heads`` under GQA)
    head_dim: Positive
    #: bytes per KV element: 2 for bf16/fp16, 4 for fp32, 1 for fp8
    kv_dtype_bytes: KvDtypeBytes

    def check(self) -> None:
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"ModelSpec.kv_heads must divide heads ({self.heads}), got {self.kv_heads} for {self.name!r}"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, for every layer and KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @classmethod
    def from_hf_config(cls, config: Any, *, name: str, params: int, kv_dtype_bytes: int) -> "ModelSpec":
        """The shape from a transformers config (read by attribute; transformers is not imported here).

        ``num_key_value_heads`` missing or None means no GQA; ``head_dim`` missing or None means
        ``hidden_size // num_attention_heads``.  The values read are checked as any ``ModelSpec``'s.
        """

        def read(attr: str) -> Any:
            value = getattr(config, attr, None)
            if value is None:
                raise ConfigError(f"model config of {name!r} has no {attr}; pass a decoder-only transformers config")
            return value

        heads = read("num_attention_heads")
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None)
        if head_dim is None:
            hidden = read("hidden_size")
            if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0):
                raise ConfigError(
                    f"model config of {name!r}: hidden_size {hidden!r} is not a multiple of "
                    f"num_attention_heads {heads!r}, and there is no head_dim"
                )
            head_dim = hidden // heads
        shape = {"layers": read("num_hidden_layers"), "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
        spec = {"name": name, "params": params, **shape, "kv_dtype_bytes": kv_dtype_bytes}
        return validated(cls, spec, f"model config of {name!r}")


KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # 70e9, as the reference analysis counts it (the checkpoint has 70.6e9)
        ModelSpec("llama-3-70b", 70_000_000_000, layers=80, heads=64, kv_heads=8, head_dim=128, kv_dtype_bytes=2),
        ModelSpec("llama-3-8b", 8_030_000_000, layers=32, heads=32, kv_heads=8, head_dim=128, kv_dtype_bytes=2),
        # the count of its config (tied embeddings); fp32, as kvpool runs it on CPU
        ModelSpec("smollm2-135m", 134_515_008, layers=30, heads=9, kv_heads=3, head_dim=64, kv_dtype_bytes=4),
    )
}


@checked
def model_spec(name: str) -> ModelSpec:
    """A model of :data:`KNOWN_MODELS` by name (case-insensitive)."""
    return KNOWN_MODELS[one_of(KNOWN_MODELS, name.lower(), "model")]


class Hardware(Config, frozen=True):
    """Effective compute and each tier's read bandwidth, and where the figures come from.

    ``bandwidth`` is stored read-only, in :data:`PATHS` order (the tiers, then ``peer``); a path without a
    figure is absent.
    """

    flops: _PositiveFinite  #: effective FLOP/s of prefill
    bandwidth: Annotated[Mapping[_Path, _PositiveFinite], Meta(description=_BANDWIDTH)]  #: tier name -> bytes/s
    source: Annotated[str, Meta(min_length=1)]  #: "reference analysis", "measured on this cluster", "overridden"
    latency_s: _NonNegativeFinite = 0.0  #: fixed cost of one reload, whatever its size (pin round trip, first bytes)
    step_s: _NonNegativeFinite = 0.0  #: fixed cost of one forward pass, whatever its length (weights read, kernels)

    def check(self) -> None:
        ordered = {t: self.bandwidth[t] for t in PATHS if t in self.bandwidth}
        msgspec.structs.force_setattr(self, "bandwidth", MappingProxyType(ordered))

    def __hash__(self) -> int:  # the read-only mapping is not hashable itself
        return hash((self.flops, tuple(self.bandwidth.items()), self.source, self.latency_s, self.step_s))

    def with_overrides(self, flops: float | None = None, **bandwidth: float | None) -> "Hardware":
        """A copy with the given figures replaced (None: keep); its source becomes "overridden".

        ``bandwidth`` keywords are tier names (``dram=64e9``), in bytes/s; a tier may be added.
        """
        given = {t: bw for t, bw in bandwidth.items() if bw is not None}
        if flops is None and not given:
            return self
        return msgspec.structs.replace(
            self,
            flops=self.flops if flops is None else flops,
            bandwidth={**self.bandwidth, **given},
            source="overridden",
        )  # every other measured figure (latency, forward step) kept


#: The design's reference analysis: stated inputs (400 TFLOPS, DRAM 64 GB/s, NVMe 14 GB/s, S3 2 GB/s), not
#: measured here; ``kvpool plan --measure`` and the workers measure this cluster's own.
REFERENCE_HARDWARE = Hardware(400e12, {"dram": 64e9, "nvme": 14e9, "remote": 2e9}, "reference analysis")


class Action(enum.Enum):
    RELOAD = "reload"  #: read the cached prefix's KV from the pool, prefill only the rest
    RECOMPUTE = "recompute"  #: prefill the whole prompt


@dataclass(frozen=True)
class Decision:
    """The router's choice for one request, with the two predictions it compared."""

    action: Action
    prompt_tokens: int
    cached_tokens: int  #: the longest prefix the pool holds
    tier: str  #: where that prefix would be read from
    reload_then_prefill_s: float  #: reload of the cached prefix plus prefill of the rest
    recompute_s: float  #: prefill of the whole prompt

    @property
    def saved_s(self) -> float:
        """Predicted seconds the chosen action saves over the other (>= 0)."""
        return abs(self.recompute_s - self.reload_then_prefill_s)

    def __str__(self) -> str:
        return (
            f"{self.action.value}: {self.cached_tokens}/{self.prompt_tokens} prompt tokens cached on {self.tier}; "
            f"reload + prefill {self.reload_then_prefill_s:.3g} s vs recompute {self.recompute_s:.3g} s"
        )


@dataclass(frozen=True)
class PlanRow:
    """One tier of the break-even table: reloading a whole prefix from it against recomputing it."""

    tier: str
    bandwidth: float  #: bytes/s
    kv_bytes: int
    reload_s: float
    prefill_s: float
    speedup: float  #: prefill_s / reload_s

    @property
    def action(self) -> Action:
        return Action.RELOAD if self.reload_s < self.prefill_s else Action.RECOMPUTE


@dataclass(frozen=True)
class CostModel:
    """Predicted prefill and reload times of one model on one :class:`Hardware`.

    With ``attention`` the prefill FLOPs include causal attention, ``4·layers·heads·head_dim`` per
    (query, key) pair; the reference analysis leaves it out, but on small models at long context it dominates.
    """

    spec: ModelSpec
    hardware: Hardware
    attention: bool = field(default=False, kw_only=True)

    @checked
    def prefill_flops(self, tokens: Tokens, cached: Tokens = 0) -> int:
        """FLOPs to compute positions ``[cached, tokens)`` with the KV of ``[0, cached)`` at hand."""
        if cached > tokens:
            raise ConfigError(f"cached must be <= tokens ({tokens}), got {cached}")
        s = tokens - cached
        flops = 2 * self.spec.params * s
        if self.attention:
            pairs = s * cached + s * (s + 1) // 2  # each new query sees the cached keys and the new ones up to it
            flops += 4 * self.spec.layers * self.spec.heads * self.spec.head_dim * pairs
        return flops

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        """The FLOPs at FLOPS_eff, plus the hardware's fixed cost of a forward pass when there is one."""
        flops = self.prefill_flops(tokens, cached)
        return flops / self.hardware.flops + (self.hardware.step_s if tokens > cached else 0.0)

    @checked
    def kv_bytes(self, tokens: Tokens) -> int:
        return tokens * self.spec.kv_bytes_per_token

    def reload_s(self, tokens: int, tier: str | Tier) -> float:
        """The hardware's fixed reload latency plus :meth:`transfer_s` (nothing to reload: 0)."""
        transfer = self.transfer_s(tokens, tier)
        return self.hardware.latency_s + transfer if tokens else transfer

    def transfer_s(self, tokens: int, tier: str | Tier) -> float:
        """Moving the KV of ``tokens`` tokens out of ``tier`` at its bandwidth."""
        return self.kv_bytes(tokens) / self._bandwidth(tier)

    def _bandwidth(self, tier: str | Tier) -> float:
        name = _tier_name(tier)
        bandwidth = self.hardware.bandwidth.get(name)
        if bandwidth is None:
            raise ConfigError(
                f"no bandwidth for tier {name!r} ({self.hardware.source}); known: {', '.join(self.hardware.bandwidth)}"
            )
        return bandwidth

    def saved_per_byte_s(self, tier: str | Tier, shrink: float = 1.0) -> float:
        """Seconds of prefill saved per byte of KV reloaded from ``tier`` instead of computed: ``2·P`` FLOPs per
        token over the KV bytes of a token, less the read (of ``1 / shrink`` of the bytes, under a codec that
        stores KV ``shrink`` times smaller).  Linear: no attention term, no fixed costs; negative where reading
        is slower than computing."""
        compute = 2 * self.spec.params / (self.hardware.flops * self.spec.kv_bytes_per_token)
        return compute - 1 / (self._bandwidth(tier) * shrink)

    @checked
    def speedup(self, tokens: SomeTokens, tier: str | Tier) -> float:
        """How many times faster reloading ``tokens`` of KV from ``tier`` is than recomputing them."""
        return self.prefill_s(tokens) / self.reload_s(tokens, tier)

    @checked
    def break_even_bandwidth(self, tokens: SomeTokens) -> float:
        """The read bandwidth (bytes/s) above which reloading ``tokens`` of KV beats recomputing them."""
        return self.kv_bytes(tokens) / self.prefill_s(tokens)

    def decide(self, prompt_tokens: int, cached_tokens: int, tier: str | Tier) -> Decision:
        """Reload the cached prefix only if that plus the rest's prefill is strictly faster than recomputing.

        With nothing cached it is RECOMPUTE, whatever the tier (its bandwidth is not looked up).
        """
        recompute = self.prefill_s(prompt_tokens)
        name = _tier_name(tier)
        if cached_tokens == 0:
            return Decision(Action.RECOMPUTE, prompt_tokens, 0, name, recompute, recompute)
        reload = self.reload_s(cached_tokens, name) + self.prefill_s(prompt_tokens, cached_tokens)
        action = Action.RELOAD if reload < recompute else Action.RECOMPUTE
        return Decision(action, prompt_tokens, cached_tokens, name, reload, recompute)

    @checked
    def break_even(self, tokens: SomeTokens) -> list[PlanRow]:
        """Reloading all ``tokens`` against recomputing them, one row per tier with a bandwidth."""
        prefill = self.prefill_s(tokens)
        return [
            PlanRow(tier, bw, self.kv_bytes(tokens), self.reload_s(tokens, tier), prefill, self.speedup(tokens, tier))
            for tier, bw in self.hardware.bandwidth.items()
        ]
