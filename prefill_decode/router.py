"""``Router``: for each request, the longest cached prefix, then reload or recompute by the cost model.

The prefix comes from the pool's watch-synced placement cache (no etcd round trip); its bytes are split by
the tier a read would take them from (the nearest replica), and the predicted reload time is the sum over
tiers.  Every decision is logged and counted, so ``stats()`` says how often the pool paid off.
"""

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.pool.keys import token_array
from kvpool.prefill_decode.connector import PoolConnector
from kvpool.prefill_decode.cost import Action, CostModel, Decision

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """What to do with one prompt."""

    decision: Decision
    keys: list[list[bytes]]  #: the pool objects of each full chunk of the prompt
    cached_chunks: int  #: leading chunks the pool holds
    sources: dict[str, int] = field(default_factory=dict)  #: bytes of the cached prefix by "tier@node"

    @property
    def reuse_chunks(self) -> int:
        """Chunks to fetch from the pool: all the cached ones on RELOAD, none on RECOMPUTE."""
        return self.cached_chunks if self.decision.action is Action.RELOAD else 0


def decide(cost: CostModel, prompt_tokens: int, cached_tokens: int, by_tier: Mapping[str, int]) -> Decision:
    """Reload the cached prefix, or recompute the prompt: the pure decision behind :meth:`Router.route`.

    ``by_tier`` holds the bytes of the cached prefix by the tier a read would take them from; the prefix's tokens
    are shared out by those bytes and priced at each tier's bandwidth.  The last prompt token is always computed.
    """
    recompute = cost.prefill_s(prompt_tokens)
    total = sum(by_tier.values())
    if cached_tokens == 0 or total == 0:
        return Decision(Action.RECOMPUTE, prompt_tokens, 0, "-", recompute, recompute)
    reload = cost.hardware.latency_s
    reload += sum(_transfer_s(cost, round(cached_tokens * b / total), t) for t, b in by_tier.items())
    reload += cost.prefill_s(prompt_tokens, min(cached_tokens, prompt_tokens - 1))
    action = Action.RELOAD if reload < recompute else Action.RECOMPUTE
    return Decision(action, prompt_tokens, cached_tokens, "+".join(sorted(by_tier)), reload, recompute)


def _transfer_s(cost: CostModel, tokens: int, tier: str) -> float:
    """``CostModel.transfer_s``; a tier without a measured figure (this node has no NVMe, but the chunk
    sits on another node's) is priced at the slowest tier known, or as never worth reloading."""
    bandwidth = cost.hardware.bandwidth
    if tier in bandwidth:
        return cost.transfer_s(tokens, tier)
    return cost.kv_bytes(tokens) / min(bandwidth.values()) if bandwidth else float("inf")


class Router:
    def __init__(self, connector: PoolConnector, cost: CostModel) -> None:
        self.connector = connector
        self.cost = cost
        self.counts: Counter[str] = Counter()

    def route(self, tokens: Sequence[int]) -> Route:
        n = len(token_array(tokens))
        keys = self.connector.keys(tokens)
        cached = self.connector.cached_chunks(keys)
        by_place = self.connector.sources(keys, cached)
        cached_tokens = min(cached * self.connector.layout.chunk_size, n) if by_place else 0  # gone meanwhile
        by_tier: Counter[str] = Counter()
        for (tier, _), nbytes in by_place.items():
            by_tier[tier] += nbytes
        decision = decide(self.cost, n, cached_tokens, by_tier)
        self.count(decision)
        log.info("route %s", decision)
        return Route(decision, keys, cached, {f"{t}@{node[:12]}": b for (t, node), b in by_place.items()})

    def count(self, decision: Decision) -> None:
        """Add one routed request to :meth:`stats`."""
        self.counts["requests"] += 1
        self.counts[decision.action.value] += 1
        self.counts["cached_tokens"] += decision.cached_tokens
        self.counts["prompt_tokens"] += decision.prompt_tokens
        if decision.cached_tokens == 0:
            self.counts["misses"] += 1

    def stats(self) -> dict[str, Any]:
        c = self.counts
        return {
            **c,
            "hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            "hardware": self.cost.hardware.source,
        }
