"""``PrefillWorker`` and ``DecodeWorker``: Ray actors around a model, a pool client, a router and a runner.

The prefill worker takes a prompt, reloads whatever prefix the router says to reload, computes the rest,
returns the first token and puts the prompt's new full chunks into the pool.  The decode worker (any
node) takes the same prompt and that first token, reloads the prompt's KV from the pool — one-sided reads
from wherever the chunks are — computes the partial last chunk the pool does not keep, and decodes.
Neither imports a transport: all KV movement goes through :class:`~kvpool.pool.client.PoolClient`.
"""

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import ray
import torch
from msgspec import Meta
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.core.config import Config, NonNegative, Positive
from kvpool.core.keys import DEFAULT_CHUNK_SIZE, CacheIdentity
from kvpool.errors import PoolFull
from kvpool.pool.config import PoolConfig
from kvpool.pool.tenants import Scope
from kvpool.prefill_decode.reference.calibrate import measure_hardware, spec_of
from kvpool.prefill_decode.reference.connector import PoolConnector
from kvpool.prefill_decode.reference.device_tier import DeviceTier
from kvpool.prefill_decode.reference.layout import LAYOUTS, KVLayout
from kvpool.prefill_decode.reference.model import MODELS, load_model
from kvpool.prefill_decode.reference.reload import Router
from kvpool.prefill_decode.reference.runner import ModelRunner, Prefilled
from kvpool.prefill_decode.routing.cost import CostModel, Hardware
from kvpool.prefill_decode.routing.router import Route

_MODELS = f"one of {', '.join(sorted(MODELS))}"
_OPTIONS = "a tuple of (name, value) pairs, e.g. (('seed', 1),)"
_LAYOUTS = f"one of {', '.join(LAYOUTS)} (G: layers per object)"

log = logging.getLogger(__name__)


class WorkerConfig(Config, frozen=True):
    pool: PoolConfig
    #: a name :func:`~kvpool.prefill_decode.reference.model.load_model` knows
    model: Annotated[str, Meta(pattern=f"^({'|'.join(map(re.escape, MODELS))})\\Z", description=_MODELS)] = "tiny-llama"
    #: keyword arguments of the loader, e.g. (("seed", 1),)
    model_options: Annotated[tuple[tuple[str, Any], ...], Meta(description=_OPTIONS)] = ()
    chunk_size: Positive = DEFAULT_CHUNK_SIZE
    #: see :mod:`kvpool.prefill_decode.reference.layout`
    layout: Annotated[str, Meta(pattern=r"^(auto|all-layers|per-layer|groups-of-[0-9]+)\Z", description=_LAYOUTS)] = (
        "auto"
    )
    hardware: Hardware | None = None  #: the cost model's figures; None: measured when the worker starts
    replicas: Positive = 1  #: copies of each chunk a prefill worker puts
    torch_threads: NonNegative = 0  #: 0: torch's default
    #: decode workers keep finished sequences' KV on the model's device up to this budget (0: off), offloading
    #: it to the pool by watermark — so the next turn of a conversation finds its prompt and answer there
    device_budget_mib: NonNegative = 0


@dataclass(frozen=True)
class PrefillSummary:
    """What one prefill did, for logs, the HTTP front and the benchmark."""

    node_id: str
    prompt_tokens: int
    action: str  #: "reload" or "recompute", as the router decided
    decision: str  #: the router's one-line reasoning
    reused_tokens: int
    computed_tokens: int
    fell_back: bool  #: a planned reload lost a chunk: recomputed
    seconds: float  #: the prefill proper (reload + compute)
    sources: dict[str, int] = field(default_factory=dict)  #: reloaded bytes by "tier@node"
    fetch_s: float = 0.0
    stall_s: float = 0.0

    @classmethod
    def of(cls, node_id: str, route: Route, pre: Prefilled) -> "PrefillSummary":
        load = pre.load
        return cls(
            node_id,
            len(pre.tokens),
            route.decision.action.value,
            str(route.decision),
            pre.reused_tokens,
            pre.computed_tokens,
            pre.fell_back,
            pre.seconds,
            route.sources if pre.reused_tokens else {},
            sum(load.fetch_s) if load else 0.0,
            load.stall_s if load else 0.0,
        )


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    ttft_s: float  #: prompt in → first token out, on the prefill worker
    summary: PrefillSummary
    saved_bytes: int  #: new KV put into the pool (0 when the pool was full: the request went on without it)
    revision: int  #: the etcd revision at which those chunks are visible


@dataclass(frozen=True)
class DecodeResult:
    tokens: list[int]  #: first token included
    summary: PrefillSummary  #: how the decode worker got the prompt's KV
    decode_s: float


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        self.loaded = load_model(config.model, **dict(config.model_options))
        from kvpool.pool.client import PoolClient  # needs Ray up: imported where it is used

        self.client = PoolClient(config.pool)
        layout = KVLayout.of(self.loaded.model, chunk_size=config.chunk_size, layout=config.layout)
        self.connector = PoolConnector(self.client, layout, layout.identity(self.loaded.name))
        hardware = config.hardware or measure_hardware(self.loaded, self.client, layout.object_bytes)
        self.router = Router(self.connector, CostModel(spec_of(self.loaded), hardware, attention=True))
        self.runner = ModelRunner(self.loaded, self.connector)

    def _prefill(self, tokens: Sequence[int], scope: Scope | None) -> tuple[Route, Prefilled]:
        route = self.router.route(tokens, scope)
        return route, self.runner.prefill(tokens, route.keys, route.reuse_chunks)

    def node_id(self) -> str:
        return self.client.node_id

    def hardware(self) -> Hardware:
        return self.router.cost.hardware

    def routing(self) -> tuple[str, KVLayout, CacheIdentity, CostModel]:
        """What a front routing to this worker needs: its node, how it names chunks, and its cost model."""
        return self.client.node_id, self.connector.layout, self.connector.identity, self.router.cost

    def stats(self) -> dict[str, Any]:
        return {"node_id": self.client.node_id, "model": self.loaded.name, **self.router.stats()}

    def close(self) -> None:
        self.connector.close()
        self.client.close()


class PrefillWorker(Worker):
    def prefill(self, tokens: Sequence[int], scope: Scope | None = None) -> PrefillResult:
        """``scope``: whose chain the prompt's chunks are keyed in (a tenant's: :mod:`kvpool.pool.tenants`)."""
        t0 = time.perf_counter()
        self.runner.prompt(tokens, 1)
        route, pre = self._prefill(tokens, scope)
        first = pre.first_token
        ttft = time.perf_counter() - t0
        skip = 0 if pre.fell_back else route.cached_chunks  # the chunks the pool already has
        saved = 0
        try:
            tenant = scope.tenant if scope is not None else ""
            saved = self.runner.save(pre, route.keys, skip, tenant) if len(route.keys) > skip else 0
        except PoolFull as exc:  # the answer does not depend on it: the decode worker recomputes what is missing
            self.router.counts["save_failed"] += 1
            log.warning("prompt KV not saved (%s); the request goes on without it", exc)
        summary = PrefillSummary.of(self.client.node_id, route, pre)
        return PrefillResult(first, ttft, summary, saved, self.client.cache.revision)


class DecodeWorker(Worker):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.device_tier = (
            DeviceTier(self.connector, config.device_budget_mib << 20, device=self.loaded.device)
            if config.device_budget_mib
            else None
        )
        self._sequences = 0

    def decode(
        self,
        tokens: Sequence[int],
        first_token: int,
        max_new_tokens: int,
        *,
        revision: int = 0,
        eos: int | None = None,
        scope: Scope | None = None,
    ) -> DecodeResult:
        """Continue ``tokens`` from ``first_token``: reload the prompt's KV (once this worker's placement
        cache has reached ``revision``, where the prefill worker's chunks are visible), then decode."""
        self.runner.prompt(tokens, max_new_tokens)
        self.client.cache.wait_until(lambda c: c.revision >= revision, timeout_s=10)
        route, pre = self._prefill(tokens, scope)
        t0 = time.perf_counter()
        out = self.runner.decode(pre, max_new_tokens, first_token=first_token, eos=eos)
        if self.device_tier is not None:  # the cache now holds the prompt and every new token but the last
            self._sequences += 1
            self.device_tier.admit(f"seq-{self._sequences}", [*pre.tokens, *out[:-1]], pre.cache, scope=scope)
        return DecodeResult(out, PrefillSummary.of(self.client.node_id, route, pre), time.perf_counter() - t0)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "device_tier": self.device_tier.stats() if self.device_tier else None}


def start_workers(config: WorkerConfig, prefill_node: str | None, decode_node: str | None) -> tuple[Any, Any]:
    """A ``PrefillWorker`` and a ``DecodeWorker`` actor (pinned to the given Ray nodes), both constructed —
    model loaded, pool joined, cost model measured — before this returns."""
    ((prefill, decode),) = start_lanes(config, [(prefill_node, decode_node)])
    return prefill, decode


def start_lanes(config: WorkerConfig, nodes: Sequence[tuple[str | None, str | None]]) -> list[tuple[Any, Any]]:
    """A ``PrefillWorker`` and a ``DecodeWorker`` actor per ``(prefill node, decode node)`` pair (Ray node ids;
    None: anywhere), all started at once and constructed before this returns."""

    def actor(kind: type[Worker], node_id: str | None) -> Any:
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
        if node_id is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return ray.remote(kind).options(**options).remote(config)

    pairs = [(actor(PrefillWorker, p), actor(DecodeWorker, d)) for p, d in nodes]
    ray.get([w.node_id.remote() for pair in pairs for w in pair])
    return pairs
