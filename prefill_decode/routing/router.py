"""Routing: reload or recompute a prompt's cached prefix (:func:`decide`; the reference engine's workers ask it
through :class:`~kvpool.prefill_decode.reference.reload.Router`), and which of several prefill/decode lanes
serves a request (``LaneRouter``: cache-aware, least-loaded or round-robin).

The prefix comes from the pool's watch-synced placement cache (no etcd round trip); its bytes are split by
the path a read would take them along (the nearest replica: the reader's own node's tier, ``peer`` for another
node's DRAM), and the predicted reload time is the sum over paths.  Every decision is logged and counted, so
``stats()`` says how often the pool paid off.  The decisions themselves (:func:`decide`, :func:`quote`,
:func:`choose`) are pure functions of the placements, the cost model and the lanes' queues.
"""

import enum
import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from msgspec import Meta

from kvpool.core.config import validated
from kvpool.core.keys import token_array
from kvpool.core.types import Placement, Tier, nearest
from kvpool.errors import ConfigError
from kvpool.pool.tenants import Scope
from kvpool.prefill_decode.routing.cost import Action, CostModel, Decision

log = logging.getLogger(__name__)

PEER = "peer"  #: the read path of a DRAM replica on another node: the network


def read_path(tier: str, holder: str, node: str) -> str:
    """What the cost model prices a read by ``node`` of a replica in ``tier`` on ``holder`` at: the tier on the
    reader's own node (and the remote tier, the same from everywhere), ``peer`` for another node's DRAM, and
    another node's NVMe at NVMe's figure (its disk is the slower of disk and network)."""
    return PEER if holder != node and tier == Tier.DRAM.value else tier


def prefix_sources(
    replicas: Callable[[bytes], Sequence[Placement]], keys: Sequence[Sequence[bytes]], chunks: int, node: str
) -> Counter[tuple[str, str]]:
    """Bytes of the first ``chunks`` chunks by ``(tier, holder)`` of the replica a reader on ``node`` would pick."""
    out: Counter[tuple[str, str]] = Counter()
    for chunk in keys[:chunks]:
        for key in chunk:
            read = nearest(replicas(key), node)
            if read is not None:
                out[(read.tier.value, read.node)] += read.size
    return out


def by_path(sources: Mapping[tuple[str, str], int], node: str) -> Counter[str]:
    """``sources`` (bytes by tier and holder) as bytes by the read path from ``node``."""
    out: Counter[str] = Counter()
    for (tier, holder), nbytes in sources.items():
        out[read_path(tier, holder, node)] += nbytes
    return out


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


def decide(
    cost: CostModel, prompt_tokens: int, cached_tokens: int, by_tier: Mapping[str, int], local_tokens: int = 0
) -> Decision:
    """Reload the cached prefix, or recompute the prompt: the pure decision behind :meth:`Router.route`.

    ``by_tier`` holds the bytes to read by the path a read would take them along (:func:`read_path`); the tokens
    read are shared out by those bytes and priced at each path's bandwidth.  ``local_tokens``: a prefix the worker
    holds itself (a vLLM engine's own prefix cache): never read, never computed; the pool's bytes are then those of
    the chunks past it.  The last prompt token is always computed.
    """
    local = min(local_tokens, prompt_tokens - 1)
    recompute = cost.prefill_s(prompt_tokens, local)
    total = sum(by_tier.values())
    if cached_tokens <= local or total == 0:
        return Decision(Action.RECOMPUTE, prompt_tokens, local, "local" if local else "-", recompute, recompute)
    fetched = cached_tokens - local
    reload = cost.hardware.latency_s
    reload += sum(_transfer_s(cost, round(fetched * b / total), t) for t, b in by_tier.items())
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


class Policy(enum.Enum):
    """How the HTTP front picks the lane (a prefill worker and its decode worker) of a request."""

    CACHE_AWARE = "cache-aware"  #: the least predicted TTFT: queued work, then reload-or-recompute on that node
    LEAST_LOADED = "least-loaded"  #: the fewest requests queued
    ROUND_ROBIN = "round-robin"  #: each lane in turn

    @classmethod
    def of(cls, name: "str | Policy", where: str = "routing policy") -> "Policy":
        """The policy called ``name``; ``ConfigError`` naming ``where`` (an option: ``--route``) otherwise."""
        return validated(_Policy, name, where)


_Policy = Annotated[Policy, Meta(description=f"one of {', '.join(p.value for p in Policy)}")]


@dataclass(frozen=True)
class Quote:
    """One lane's prediction for a prompt: the prefill work queued before it, then its own prefill there."""

    lane: int
    decision: Decision  #: reload or recompute, priced from the lane's node
    queued: int  #: requests sent to the lane's prefill worker and not back yet
    queued_s: float  #: their predicted prefill seconds
    keys: tuple[bytes, ...] = field(default=(), repr=False, compare=False)  #: the prompt's chunk objects

    @property
    def prefill_s(self) -> float:
        d = self.decision
        return d.reload_then_prefill_s if d.action is Action.RELOAD else d.recompute_s

    @property
    def ttft_s(self) -> float:
        return self.queued_s + self.prefill_s


def choose(policy: Policy, quotes: Sequence[Quote], turn: int) -> Quote:
    """The lane ``policy`` sends a request to; ties go to the lane after the last one chosen (``turn`` counts
    requests), so equal lanes share the work."""
    if not quotes:
        raise ConfigError("no lanes to route to: start at least one prefill worker")
    n = len(quotes)
    if policy is Policy.ROUND_ROBIN:
        return quotes[turn % n]
    after = {q.lane: (q.lane - turn) % n for q in quotes}
    if policy is Policy.LEAST_LOADED:
        return min(quotes, key=lambda q: (q.queued, after[q.lane]))
    return min(quotes, key=lambda q: (q.ttft_s, q.queued, after[q.lane]))


def one_identity(identities: Sequence[Any], lane: str = "lane") -> None:
    """Every lane names chunks alike (one cache identity and layout), or a router could not predict their hits."""
    for i, other in enumerate(identities):
        if other != identities[0]:
            raise ConfigError(
                f"{lane} {i} caches under another identity or layout than {lane} 0: start every {lane} alike"
            )


class LaneRouter:
    """Sends each request to a lane by ``policy`` and keeps every lane's queue.

    ``nodes[i]`` and ``costs[i]`` are lane ``i``'s prefill worker's node and cost model; ``keys`` names a prompt's
    chunk objects (the workers' cache identity and layout), ``replicas`` is the placement cache's lookup.
    :meth:`pick` books the chosen lane's predicted prefill, and the prompt's chunks as soon to be in that node's
    DRAM, until :meth:`release`.
    """

    def __init__(
        self,
        nodes: Sequence[str],
        costs: Sequence[CostModel],
        keys: Callable[[Sequence[int], Scope | None], list[list[bytes]]],
        chunk_size: int,
        replicas: Callable[[bytes], Sequence[Placement]],
        policy: "Policy | str" = Policy.CACHE_AWARE,
    ) -> None:
        if not nodes or len(nodes) != len(costs):
            raise ConfigError(f"need one cost model per lane and at least one lane, got {len(nodes)} and {len(costs)}")
        self.nodes, self.costs = list(nodes), list(costs)
        self.keys, self.chunk_size, self.replicas = keys, chunk_size, replicas
        self.policy = Policy.of(policy)
        self._queued = [0] * len(nodes)
        self._queued_s = [0.0] * len(nodes)
        #: chunk objects of the requests queued on each lane: in that node's DRAM by the time it gets to the next
        self._pending: list[Counter[bytes]] = [Counter() for _ in nodes]
        self._turn = 0
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def serves(self, lanes: int, front: str = "the service", lane: str = "lanes") -> None:
        """That this router routes over ``front``'s ``lanes`` lanes (the same ones, in the same order)."""
        if len(self.nodes) != lanes:
            raise ConfigError(f"the router knows {len(self.nodes)} {lane}, {front} has {lanes}: build it over the same")

    def quotes(self, tokens: Sequence[int], scope: Scope | None = None) -> list[Quote]:
        """Every lane's prediction for ``tokens`` (keyed in ``scope``: a tenant's chain), as things stand."""
        tokens = [int(t) for t in token_array(tokens)]
        keys = self.keys(tokens, scope)
        cached = 0
        while cached < len(keys) and all(self.replicas(k) for k in keys[cached]):
            cached += 1
        flat = tuple(k for chunk in keys for k in chunk)
        return [self.quote(lane, tokens, scope, keys, cached, flat) for lane in range(len(self.nodes))]

    def quote(
        self,
        lane: int,
        tokens: Sequence[int],
        scope: Scope | None,
        keys: list[list[bytes]],
        cached: int,
        flat: tuple[bytes, ...],
    ) -> Quote:
        """Lane ``lane``'s prediction for ``tokens``, whose chunk objects are ``keys`` (``flat``: all of them), the
        first ``cached`` of which the pool holds."""
        node, cost = self.nodes[lane], self.costs[lane]
        n = len(tokens)
        paths = by_path(prefix_sources(self.replicas, keys, cached, node), node)
        ahead = self.ahead(lane, keys, cached)  # put by a request queued before this one, on this node
        if ahead > cached:
            paths[Tier.DRAM.value] += cost.kv_bytes((ahead - cached) * self.chunk_size)
        cached_tokens = min(ahead * self.chunk_size, n) if paths else 0
        return Quote(lane, decide(cost, n, cached_tokens, paths), self._queued[lane], self._queued_s[lane], flat)

    def ahead(self, lane: int, keys: list[list[bytes]], start: int) -> int:
        """Leading chunks, from ``start`` on, whose objects are held or will be put by a request queued on ``lane``."""
        pending = self._pending[lane]
        while start < len(keys) and all(self.replicas(k) or pending[k] for k in keys[start]):
            start += 1
        return start

    def pick(self, tokens: Sequence[int], scope: Scope | None = None) -> Quote:
        """The lane for ``tokens``, booked: call :meth:`release` with the quote once its prefill is done."""
        with self._lock:
            quote = choose(self.policy, self.quotes(tokens, scope), self._turn)
            self._turn += 1
            self._queued[quote.lane] += 1
            self._queued_s[quote.lane] += quote.prefill_s
            self._pending[quote.lane].update(quote.keys)
            self.counts["requests"] += 1
            self.counts[f"lane{quote.lane}"] += 1
            self.counts["cached_tokens"] += quote.decision.cached_tokens
            self.counts["prompt_tokens"] += quote.decision.prompt_tokens
        log.info("lane %d (%s): predicted TTFT %.3g s; %s", quote.lane, self.policy.value, quote.ttft_s, quote.decision)
        return quote

    def release(self, quote: Quote) -> None:
        with self._lock:
            self._queued[quote.lane] -= 1
            self._queued_s[quote.lane] = max(0.0, self._queued_s[quote.lane] - quote.prefill_s)
            self._pending[quote.lane] -= Counter(quote.keys)  # keeps only positive counts

    def stats(self) -> dict[str, Any]:
        c = self.counts
        return {
            "policy": self.policy.value,
            "lanes": [
                {"node": node, "requests": c[f"lane{i}"], "queued": self._queued[i]}
                for i, node in enumerate(self.nodes)
            ],
            "requests": c["requests"],
            "hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
        }
