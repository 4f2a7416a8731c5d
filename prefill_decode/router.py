"""``Router``: for each request, the longest cached prefix, then reload or recompute by the cost model.

The prefix comes from the pool's watch-synced placement cache (no etcd round trip); its bytes are split by
the tier a read would take them from (the nearest replica), and the predicted reload time is the sum over
tiers.  Every decision is logged and counted, so ``stats()`` says how often the pool paid off.
"""

import logging
from collections import Counter
from collections.abc import Sequence
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
        recompute = self.cost.prefill_s(n)
        if cached_tokens == 0:
            decision = Decision(Action.RECOMPUTE, n, 0, "-", recompute, recompute)
        else:
            by_tier: Counter[str] = Counter()
            for (tier, _), nbytes in by_place.items():
                by_tier[tier] += nbytes
            total = sum(by_tier.values())
            # the prefix's tokens, shared out by where their bytes are; the last prompt token is always computed
            reload = self.cost.hardware.latency_s
            reload += sum(self._transfer_s(round(cached_tokens * b / total), t) for t, b in by_tier.items())
            reload += self.cost.prefill_s(n, min(cached_tokens, n - 1))
            action = Action.RELOAD if reload < recompute else Action.RECOMPUTE
            decision = Decision(action, n, cached_tokens, "+".join(sorted(by_tier)), reload, recompute)
        route = Route(decision, keys, cached, {f"{t}@{node[:12]}": b for (t, node), b in by_place.items()})
        self.counts["requests"] += 1
        self.counts[decision.action.value] += 1
        self.counts["cached_tokens"] += cached_tokens
        self.counts["prompt_tokens"] += n
        if cached_tokens == 0:
            self.counts["misses"] += 1
        log.info("route %s", decision)
        return route

    def _transfer_s(self, tokens: int, tier: str) -> float:
        """``CostModel.transfer_s``; a tier without a measured figure (this node has no NVMe, but the chunk
        sits on another node's) is priced at the slowest tier known, or as never worth reloading."""
        bandwidth = self.cost.hardware.bandwidth
        if tier in bandwidth:
            return self.cost.transfer_s(tokens, tier)
        return self.cost.kv_bytes(tokens) / min(bandwidth.values()) if bandwidth else float("inf")

    def stats(self) -> dict[str, Any]:
        c = self.counts
        return {
            **c,
            "hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            "hardware": self.cost.hardware.source,
        }
