"""Serving over vLLM engines with the kvpool connector: each request goes to the engine the
:class:`~kvpool.prefill_decode.routing.engine_router.EngineRouter` predicts the least time to first token for.

The engines run in processes of their own (:class:`~kvpool.prefill_decode.vllm.engine.EngineProcess`), one per
pool node, each publishing its prefix cache's block events to the front's :class:`EngineEvents` socket.  Each
engine's cost model is measured when the front starts (:func:`calibrate`): a cold prefill, the same prompt from the
engine's own cache, from its node's pool DRAM, and from another node's: the figures the router prices with.
"""

import asyncio
import json
import logging
import os
import statistics
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kvpool.core.keys import CacheIdentity, chunk_keys, layer_key
from kvpool.errors import ConfigError, KvPoolError, WorkerUnavailable
from kvpool.pool.tenants import Scope
from kvpool.prefill_decode.routing.cost import CostModel, Hardware, ModelSpec
from kvpool.prefill_decode.routing.engine_router import EngineEvents, EngineRouter
from kvpool.prefill_decode.routing.router import Policy, Quote, one_identity
from kvpool.prefill_decode.vllm.engine import EngineProcess, Forker

if TYPE_CHECKING:
    from aiohttp import web

    from kvpool.pool.config import PoolConfig

log = logging.getLogger(__name__)

SAVE_WAIT_S = 120.0  #: how long calibration waits for an engine's saves to reach the pool
MIN_READ_S = 1e-3  #: a read that took no longer than a step is taken as this long (a floor, not a measurement)


@dataclass(frozen=True)
class EngineLane:
    """One engine: its process, the pool node its connector reads and writes through, its KV events' topic."""

    engine: EngineProcess
    node: str
    topic: str


@dataclass(frozen=True)
class EngineCompletion:
    tokens: list[int]  #: generated
    lane: int
    seconds: float  #: request in → answer out, the wait for the engine included (with max_tokens 1: the TTFT)
    cached: int  #: prompt tokens vLLM did not compute (its own cache and the pool's)
    quote: Quote


def model_spec(model_dir: str | Path, kv_dtype_bytes: int = 4) -> ModelSpec:
    """The cost model's view of a Llama-style model directory (``config.json``): ``P`` counts the decoder layers'
    weights (attention and gated MLP), as :func:`~kvpool.prefill_decode.reference.calibrate.spec_of` does for a loaded one."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
        hidden, heads, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path}: not a Llama-style model config ({exc}); pass a model directory vLLM loads"
        ) from None
    return ModelSpec.from_hf_config(
        SimpleNamespace(**cfg),
        name=path.parent.name,
        params=per_layer * cfg["num_hidden_layers"],
        kv_dtype_bytes=kv_dtype_bytes,
    )


def _ttft(engine: EngineProcess, prompt: list[int], reset: bool = False) -> float:
    [out] = engine.generate([prompt], reset=reset, max_tokens=1)
    return float(out["seconds"])


def wait_saved(engine: EngineProcess, tokens: int) -> None:
    """Until ``engine``'s connector has saved ``tokens`` prompt tokens since it started (its saves run after the
    answer); ``WorkerUnavailable`` after :data:`SAVE_WAIT_S`."""
    deadline = time.monotonic() + SAVE_WAIT_S
    while engine.ask(connector=True)["totals"].get("saved_tokens", 0) < tokens:
        if time.monotonic() > deadline:
            raise WorkerUnavailable(f"an engine did not save {tokens} tokens to the pool in {SAVE_WAIT_S:.0f} s")
        time.sleep(0.05)


def calibrate(
    lanes: Sequence[EngineLane], spec: ModelSpec, chunk_size: int, tokens: int = 1024, vocab: int = 4000
) -> list[CostModel]:
    """Each engine's cost model, measured: effective FLOP/s from a cold prefill of ``tokens`` tokens, the fixed cost
    of a step from the same prompt out of the engine's own cache, and the read bandwidth of its node's DRAM (the
    prompt again after ``reset_prefix_cache``) and of another node's (the next engine, which never saw it).  Few
    timings (two cold prompts, three steps, a read each after an untimed first), on purpose: the router needs
    orders of magnitude, and the engines' start is slow enough."""
    count = CostModel(spec, Hardware(1.0, {}, "count"), attention=True)
    loaded = ((tokens - 1) // chunk_size) * chunk_size  # vLLM computes the last token itself
    if loaded < chunk_size:
        raise ConfigError(f"calibration needs a prompt longer than one chunk of {chunk_size} tokens; got {tokens}")
    kv = count.kv_bytes(loaded)
    costs = []
    for i, lane in enumerate(lanes):
        prompts = [[(seed * 7919 + t * 104729 + 13 * i) % vocab + 1 for t in range(tokens)] for seed in (1, 2, 3)]
        _ttft(lane.engine, prompts[0])  # warm-up: the first forward passes of an engine are slow
        saved = lane.engine.ask(connector=True)["totals"].get("saved_tokens", 0)
        cold = statistics.median(_ttft(lane.engine, p) for p in prompts[1:])
        wait_saved(lane.engine, saved + 2 * loaded)
        step = statistics.median(_ttft(lane.engine, prompts[1]) for _ in range(3))
        _ttft(lane.engine, prompts[2], reset=True)  # the connector's first load sets up its reads: the second is timed
        own = _ttft(lane.engine, prompts[1], reset=True) - step
        bandwidth = {"dram": kv / max(own, MIN_READ_S)}
        if len(lanes) > 1:  # the first read from a node sets up the connection to it: the second one is timed
            other = lanes[(i + 1) % len(lanes)].engine
            _ttft(other, prompts[1], reset=True)
            bandwidth["peer"] = kv / max(_ttft(other, prompts[2], reset=True) - step, MIN_READ_S)
        flops = count.prefill_flops(tokens) / max(cold - step, MIN_READ_S)
        costs.append(CostModel(spec, Hardware(flops, bandwidth, "measured on this engine", 0.0, step), attention=True))
        log.info(
            "engine %d: cold %.3f s, step %.3f s, own DRAM %.2f GB/s%s",
            i,
            cold,
            step,
            bandwidth["dram"] / 1e9,
            f", peer {bandwidth['peer'] / 1e9:.2f} GB/s" if "peer" in bandwidth else "",
        )
    return costs


def engine_keys(identity: CacheIdentity, layers: int, tokens: Sequence[int], scope: Scope | None) -> list[list[bytes]]:
    """The pool objects of each full chunk of ``tokens``: one per layer, as the vLLM connector's worker names them."""
    return [[layer_key(k, layer) for layer in range(layers)] for k in chunk_keys(identity, tokens, scope)]


class Prefetcher:
    """Brings a routed prompt's pool chunks into its engine's node's DRAM while the request waits for the engine
    (:meth:`PoolClient.prefetch`), on a thread of its own with a pool client of its own (a client is used by one
    thread).  A prefetch that fails is logged and counted: the engine then reads the chunks where they are."""

    def __init__(self, pool: "PoolConfig") -> None:
        self.pool = pool
        self.counts = {"asked": 0, "promoted": 0, "copied": 0, "failed": 0}
        self._client: Any = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvpool-prefetch")

    def submit(self, keys: Sequence[bytes], node: str) -> Any:
        """The prefetch of ``keys`` into ``node``, queued (a future of its :class:`Prefetched`, None if it failed)."""
        return self._thread.submit(self._run, list(keys), node)

    def _run(self, keys: list[bytes], node: str) -> Any:
        from kvpool.pool.client import PoolClient

        self.counts["asked"] += 1
        try:
            self._client = self._client or PoolClient(self.pool)
            done = self._client.prefetch(keys, node)
        except KvPoolError as exc:
            self.counts["failed"] += 1
            log.warning("prefetch into %s failed (the engine reads the chunks where they are): %s", node[:12], exc)
            return None
        self.counts["promoted"] += done.promoted
        self.counts["copied"] += done.copied
        return done

    def close(self) -> None:
        self._thread.submit(lambda: self._client and self._client.close()).result()
        self._thread.shutdown()


class EngineFront:
    """Sends each request to an engine by the router's policy; one request at a time per engine (the engine's own
    batching is not used, so the router's queue is the engine's), any number of callers at once.  With a
    ``prefetcher``, a request that has to wait for its engine first has the pool's chunks of its prompt brought to
    that engine's node (NVMe, S3 or another node → its DRAM), so the wait pays for the move."""

    def __init__(
        self,
        lanes: Sequence[EngineLane],
        events: EngineEvents,
        router: EngineRouter,
        prefetcher: Prefetcher | None = None,
    ) -> None:
        router.serves(len(lanes), "the front", "engines")
        self.lanes, self.events, self.router, self.prefetcher = list(lanes), events, router, prefetcher
        self._locks = [threading.Lock() for _ in lanes]

    @classmethod
    def over(
        cls,
        lanes: Sequence[EngineLane],
        events: EngineEvents,
        costs: Sequence[CostModel],
        replicas: Any,
        chunk_size: int,
        policy: "Policy | str" = Policy.CACHE_AWARE,
        prefetcher: Prefetcher | None = None,
    ) -> "EngineFront":
        """A front over ``lanes`` whose router reads placements with ``replicas`` (a watch cache's); every engine
        must cache under one identity, or the router could not predict their hits."""
        states = [lane.engine.ask(connector=True) for lane in lanes]
        one_identity([(state["identity"], state["layers"]) for state in states], "engine")
        identity, layers = states[0]["identity"], states[0]["layers"]
        topics = [lane.topic for lane in lanes]

        def local(lane: int, tokens: Sequence[int], scope: Scope | None) -> int:
            return 0 if scope is not None else events.cached_tokens(topics[lane], tokens)  # salted: not tracked

        keys = partial(engine_keys, CacheIdentity(**identity), layers)
        router = EngineRouter([lane.node for lane in lanes], costs, keys, chunk_size, replicas, local, policy)
        return cls(lanes, events, router, prefetcher)

    def complete(self, tokens: list[int], max_tokens: int = 1) -> EngineCompletion:
        started = time.perf_counter()
        quote = self.router.pick(tokens)
        try:
            if self.prefetcher is not None and self._locks[quote.lane].locked():  # it waits: the move uses the wait
                self.prefetcher.submit(quote.keys, self.lanes[quote.lane].node)
            with self._locks[quote.lane]:
                [out] = self.lanes[quote.lane].engine.generate([tokens], max_tokens=max_tokens)
        finally:
            self.router.release(quote)
        return EngineCompletion(out["tokens"], quote.lane, time.perf_counter() - started, out["cached"], quote)


def start_engine_lanes(
    settings: dict[str, Any],
    connector: dict[str, Any],
    node_ips: Sequence[str],
    events: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    bind_cores: bool = False,
    zygote: Forker | None = None,
) -> list[EngineLane]:
    """One engine per Ray node in ``node_ips`` (its connector on that node's PoolNode), started at once, each
    publishing KV events to ``events`` under topic ``engine<i>``.  ``connector``: the ``kv_connector_extra_config``
    they share (``node_ip`` is set per engine).  ``bind_cores``: engine ``i`` computes on core ``i`` alone (vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND``), so engines on one machine do not slow each other as separate hosts would not.
    ``zygote``: engines forked from it where they can be (:mod:`~kvpool.prefill_decode.vllm.zygote`)."""

    def start(i: int, ip: str) -> EngineProcess:
        extra = {**connector, "node_ip": ip}
        lane_settings = {**settings, "connector": extra, "kv_events": {"endpoint": events, "topic": f"engine{i}"}}
        bound = {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))} if bind_cores else {}
        return EngineProcess(lane_settings, log_dir / f"engine{i}.log", env={**(env or {}), **bound}, zygote=zygote)

    with ThreadPoolExecutor(len(node_ips)) as pool:
        futures = [pool.submit(start, i, ip) for i, ip in enumerate(node_ips)]
    failed = [exc for f in futures if (exc := f.exception()) is not None]
    engines = [f.result() for f in futures if f.exception() is None]
    if failed:
        for e in engines:
            e.close()
        raise failed[0]
    lanes = []
    for i, engine in enumerate(engines):
        _ttft(engine, [1, 2, 3])  # the connector's pool client connects on the engine's first steps
        deadline = time.monotonic() + 60
        while not (node := engine.ask(connector=True)["node"]):
            if time.monotonic() > deadline:
                raise WorkerUnavailable(f"engine {i}'s connector did not reach the pool on {node_ips[i]}; see its log")
            time.sleep(0.1)
        lanes.append(EngineLane(engine, node, f"engine{i}"))
    return lanes


def make_engine_app(front: EngineFront, model: str, tokenizer: Any = None, vocab: int = 0) -> "web.Application":
    """OpenAI-style ``/v1/completions`` (and ``/v1/models``, ``/health``, ``/stats``) over ``front``'s engines; the
    same request body as the workers' front, answered by the engine the router picks.  ``vocab``: token ids at or
    above it are refused before they reach an engine.  Tenants are not served here (see docs/routing.md)."""
    from aiohttp import web

    from kvpool.prefill_decode.front.openai import completion_request, error_response, front_app, untenanted
    from kvpool.prefill_decode.reference.model import tokenize
    from kvpool.prefill_decode.reference.runner import prompt_array

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await completion_request(request)
            untenanted(request.headers.get("Authorization"), body.cache_namespace, " (the workers' front serves them)")
            tokens = tokenize(tokenizer, model, body.prompt, chat=body.chat)
            prompt_array(tokens, vocab=vocab, model=model)
            done = await asyncio.to_thread(front.complete, tokens, body.max_tokens)
        except ConfigError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        except KvPoolError as exc:
            log.warning("completion failed: %s", exc)
            return error_response(503, f"{type(exc).__name__}: {exc}", "server_error")
        text = tokenizer.decode(done.tokens, skip_special_tokens=True) if tokenizer is not None else ""
        return web.json_response(
            {
                "id": f"cmpl-{uuid.uuid4().hex[:24]}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {"index": 0, "text": text, "tokens": done.tokens, "finish_reason": "length", "logprobs": None}
                ],
                "usage": {
                    "prompt_tokens": len(tokens),
                    "completion_tokens": len(done.tokens),
                    "total_tokens": len(tokens) + len(done.tokens),
                },
                "kvpool": {
                    "engine": done.lane,
                    "seconds": done.seconds,
                    "cached_tokens": done.cached,
                    "predicted_ttft_s": done.quote.ttft_s,
                    "prefix_from": done.quote.decision.tier,
                },
            }
        )

    async def stats(_: web.Request) -> web.Response:
        engines = [
            {"topic": lane.topic, "node": lane.node, "blocks": len(front.events.indexes[lane.topic])}
            for lane in front.lanes
        ]
        events = {"applied": front.events.events, "gaps": front.events.gaps}
        prefetch = front.prefetcher.counts if front.prefetcher is not None else None
        return web.json_response(
            {"engines": engines, "router": front.router.stats(), "events": events, "prefetch": prefetch}
        )

    return front_app(model, completions, stats)
