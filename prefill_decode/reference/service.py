"""``Service``: one request end to end — prefill worker, pool, decode worker — and the OpenAI-style HTTP
front on top of it (``POST /v1/completions``, ``GET /v1/models``, ``GET /health``, ``GET /stats``).

The front tokenizes (when the model has a tokenizer; token-id prompts work for any model), picks a lane (a
prefill worker and its decode worker; with several, by the :class:`~kvpool.prefill_decode.routing.router.LaneRouter`'s
policy), asks the prefill worker for the first token, hands the prompt and that token to the decode worker,
and answers in the shape of OpenAI's completions API, with a ``kvpool`` field saying which lane served it and
where the prompt's KV came from.
"""

import asyncio
import logging
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Annotated, Any

import ray
from aiohttp import web
from msgspec import Meta

from kvpool.core.config import Positive, checked, validated
from kvpool.errors import ConfigError, KvPoolError, TenantRefused, WorkerUnavailable
from kvpool.pool.tenants import Scope, Tenants
from kvpool.prefill_decode.front.openai import completion_request, error_response, front_app, untenanted
from kvpool.prefill_decode.reference.model import tokenize
from kvpool.prefill_decode.reference.workers import DecodeResult, PrefillResult
from kvpool.prefill_decode.routing.router import LaneRouter, Policy, Quote, one_identity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    prompt_tokens: list[int]
    tokens: list[int]  #: the generated tokens, first one included
    ttft_s: float  #: request in → first token out (prefill worker)
    total_s: float
    prefill: PrefillResult
    decode: DecodeResult
    lane: int = 0
    quote: Quote | None = None  #: the router's prediction for the lane it chose (None: one lane, no router)


@dataclass(frozen=True)
class Lane:
    """A prefill actor and the decode actor its requests go on to (a pair from
    :func:`~kvpool.prefill_decode.reference.workers.start_lanes`)."""

    prefill: Any
    decode: Any


_LANES = "a Lane(prefill, decode), or a list of at least one"


class Service:
    """One or more lanes; with several, ``router`` (over the same lanes, in the same order) picks each request's."""

    @checked
    def __init__(
        self,
        lanes: Annotated[Lane | Annotated[Sequence[Lane], Meta(min_length=1)], Meta(description=_LANES)],
        *,
        model: str,
        tokenizer: Any = None,
        eos: int | None = None,
        router: LaneRouter | None = None,
        tenants: Annotated[Tenants | None, Meta(description="a Tenants (Tenants.load(path)) or None")] = None,
    ) -> None:
        self.lanes = [lanes] if isinstance(lanes, Lane) else list(lanes)
        if router is None and len(self.lanes) > 1:
            raise ConfigError(f"{len(self.lanes)} lanes need a LaneRouter to choose between them")
        if router is not None:
            router.serves(len(self.lanes))
        self.router = router
        self.tenants = tenants  #: when set, every request is a tenant's (its API key), keyed in the tenant's chain
        self.model = model
        self.tokenizer = tokenizer
        self.eos = eos
        #: per tenant ("" for requests of none): requests, prompt tokens, and prompt tokens reloaded from the pool
        self.tenant_counts: dict[str, Counter[str]] = defaultdict(Counter)

    def tokenize(self, prompt: str | list[int], *, chat: bool = False) -> list[int]:
        return tokenize(self.tokenizer, self.model, prompt, chat=chat)

    def detokenize(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def scope(self, api_key: str | None, namespace: str = "") -> Scope | None:
        """The scope of a request that came with ``api_key`` (None: no tenants here) and asked for the shared
        ``namespace`` (""), or ``TenantRefused``: with tenants, a request without a tenant's key is refused."""
        if self.tenants is None:
            untenanted(api_key, namespace, " (or start it with --tenants)")
            return None
        return self.tenants.scope(self.tenants.by_api_key(api_key or ""), namespace)

    async def complete(self, tokens: list[int], max_tokens: int, scope: Scope | None = None) -> Completion:
        """``scope``: whose chain the prompt's chunks are keyed in (:meth:`scope`); None: the identity's own.  The
        prefill worker checks the prompt (:meth:`~kvpool.prefill_decode.reference.runner.ModelRunner.prompt`): not
        @checked here, which would convert every token id once more on the front's event loop."""
        validated(Positive, max_tokens, "max_tokens")
        t0 = time.perf_counter()
        quote = self.router.pick(tokens, scope) if self.router is not None else None
        lane = self.lanes[quote.lane if quote is not None else 0]
        try:
            try:
                first: PrefillResult = await lane.prefill.prefill.remote(tokens, scope)
            finally:
                if quote is not None and self.router is not None:
                    self.router.release(quote)
            ttft = time.perf_counter() - t0
            done: DecodeResult = await lane.decode.decode.remote(
                tokens, first.first_token, max_tokens, revision=first.revision, eos=self.eos, scope=scope
            )
        except ray.exceptions.RayTaskError as exc:  # a worker's own error (a bad prompt, a pool error): as itself
            if isinstance(exc.cause, KvPoolError):
                raise exc.cause from None
            raise
        except ray.exceptions.RayActorError as exc:
            raise WorkerUnavailable(f"a prefill or decode worker died: {exc}; restart the service") from exc
        index = quote.lane if quote is not None else 0
        counts = self.tenant_counts[scope.tenant if scope is not None else ""]
        counts.update(requests=1, prompt_tokens=len(tokens), reused_tokens=first.summary.reused_tokens)
        return Completion(tokens, done.tokens, ttft, time.perf_counter() - t0, first, done, index, quote)

    def complete_sync(self, tokens: list[int], max_tokens: int, scope: Scope | None = None) -> Completion:
        return asyncio.run(self.complete(tokens, max_tokens, scope))


def lane_router(lanes: Sequence[Lane], replicas: Any, policy: "Policy | str" = Policy.CACHE_AWARE) -> LaneRouter:
    """A :class:`LaneRouter` over ``lanes`` (their prefill workers' nodes and cost models), reading placements
    with ``replicas`` (a :class:`~kvpool.metadata.cache.MetadataCache`'s ``replicas``).  Every lane must name
    chunks alike (one cache identity and layout), or the router could not predict their hits."""
    infos = ray.get([lane.prefill.routing.remote() for lane in lanes])
    one_identity([(layout, identity) for _, layout, identity, _ in infos])
    _, layout, identity, _ = infos[0]
    return LaneRouter(
        [node for node, *_ in infos],
        [cost for *_, cost in infos],
        partial(layout.keys, identity),
        layout.chunk_size,
        replicas,
        policy,
    )


def _completion(service: Service, tokens: list[int], done: Completion) -> dict[str, Any]:
    """The OpenAI-style body of a finished completion, with kvpool's timings beside it."""
    finish = "stop" if service.eos is not None and done.tokens[-1] == service.eos else "length"
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": service.model,
        "choices": [
            {
                "index": 0,
                "text": service.detokenize(done.tokens),
                "tokens": done.tokens,
                "finish_reason": finish,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": len(tokens),
            "completion_tokens": len(done.tokens),
            "total_tokens": len(tokens) + len(done.tokens),
        },
        "kvpool": {
            "ttft_s": done.ttft_s,
            "total_s": done.total_s,
            "lane": done.lane,
            "predicted_ttft_s": done.quote.ttft_s if done.quote is not None else None,
            "prefill": asdict(done.prefill.summary),
            "decode": asdict(done.decode.summary),
        },
    }


def make_app(service: Service) -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        try:
            body = await completion_request(request)
        except ConfigError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        try:
            scope = service.scope(key or None, body.cache_namespace)
        except TenantRefused as exc:  # 401: no tenant's key; 403: a tenant's, asking for what it may not use
            known = service.tenants is not None and service.tenants.knows(key)
            return error_response(403 if known else 401, str(exc), "authentication_error")
        except ConfigError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        try:
            tokens = service.tokenize(body.prompt, chat=body.chat)
            done = await service.complete(tokens, body.max_tokens, scope)
        except ConfigError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        except KvPoolError as exc:
            log.warning("completion failed: %s", exc)
            return error_response(503, f"{type(exc).__name__}: {exc}", "server_error")
        return web.json_response(_completion(service, tokens, done))

    async def stats(_: web.Request) -> web.Response:
        calls = [w.stats.remote() for lane in service.lanes for w in (lane.prefill, lane.decode)]
        got = await asyncio.gather(*calls)
        lanes = [{"prefill": got[2 * i], "decode": got[2 * i + 1]} for i in range(len(service.lanes))]
        router = service.router.stats() if service.router is not None else None
        tenants = {t: dict(c) for t, c in service.tenant_counts.items()}
        return web.json_response({"lanes": lanes, "router": router, "tenants": tenants})

    return front_app(service.model, completions, stats)
