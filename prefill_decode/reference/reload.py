"""``Router``: a reference worker's reload-or-recompute, per request: the prompt's chunk keys, how many leading chunks
the pool holds and along which read paths (:func:`~kvpool.prefill_decode.routing.router.prefix_sources`), and the
cost model's verdict (:func:`~kvpool.prefill_decode.routing.router.decide`), logged and counted."""

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvpool.core.keys import token_array
from kvpool.pool.tenants import Scope
from kvpool.prefill_decode.reference.connector import PoolConnector
from kvpool.prefill_decode.routing.cost import CostModel, Decision
from kvpool.prefill_decode.routing.router import Route, by_path, decide, prefix_sources

log = logging.getLogger(__name__)


class Router:
    def __init__(self, connector: PoolConnector, cost: CostModel) -> None:
        self.connector = connector
        self.cost = cost
        self.counts: Counter[str] = Counter()

    def route(self, tokens: Sequence[int], scope: Scope | None = None) -> Route:
        n = len(token_array(tokens))
        keys = self.connector.keys(tokens, scope)
        cached = self.connector.cached(keys, n).held
        here = self.connector.client.node_id
        by_place = prefix_sources(self.connector.client.cache.replicas, keys, cached, here)
        cached_tokens = min(cached * self.connector.layout.chunk_size, n) if by_place else 0  # gone meanwhile
        decision = decide(self.cost, n, cached_tokens, by_path(by_place, here))
        self.count(decision)
        self.counts["chunks"] += len(keys)  # full chunks looked up, and how many of them the pool held
        self.counts["cached_chunks"] += cached
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
