"""The OpenAI-shaped HTTP surface every kvpool front shares: the reference engine's lanes
(:mod:`~kvpool.prefill_decode.reference.service`), kvpool-started vLLM engines (:mod:`~kvpool.prefill_decode.vllm.front`)
and upstream engines it did not start (:mod:`~kvpool.prefill_decode.front.upstream`): the routes of an app
(``/v1/completions``, ``/v1/models``, ``/health``, ``/stats``), a completions body read and checked once, and errors in
OpenAI's shape."""

from collections.abc import Awaitable, Callable
from typing import Annotated

import msgspec
from aiohttp import web
from msgspec import Meta

from kvpool.core.config import validated
from kvpool.core.keys import TokenId
from kvpool.errors import ConfigError

Handler = Callable[[web.Request], Awaitable[web.Response]]


def error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


def untenanted(api_key: str | None, namespace: str, hint: str = "") -> None:
    """A request to a front that serves no tenants must name none (``hint``: where tenants are served)."""
    if api_key or namespace:
        raise ConfigError(f"this front serves no tenants: send no API key or cache_namespace{hint}")


class CompletionRequest(msgspec.Struct, frozen=True):
    """What kvpool reads of a ``/v1/completions`` body; the other fields an OpenAI client sends (``model``,
    ``temperature``...) are not refused, and not used."""

    prompt: Annotated[
        Annotated[str, Meta(min_length=1)] | Annotated[list[TokenId], Meta(min_length=1)],
        Meta(description="a string or a list of token ids, not empty"),
    ]
    max_tokens: Annotated[int, Meta(ge=1, le=4096, description="an int in [1, 4096]")] = 16
    #: a shared namespace of the tenants file; "": the tenant's own
    cache_namespace: Annotated[str, Meta(description="a shared namespace of the tenants file")] = ""
    chat: bool = False  #: the prompt is a user's message, put in the model's chat template


async def completion_request(request: web.Request) -> CompletionRequest:
    """A ``/v1/completions`` body, or a ``ConfigError`` naming the field that is wrong (the front answers it with
    a 400)."""
    try:
        body = await request.json()
    except ValueError:
        raise ConfigError("the body must be JSON") from None
    return validated(CompletionRequest, body, "the /v1/completions body")


def front_app(model: str, completions: Handler, stats: Handler) -> web.Application:
    """What every OpenAI-style front of kvpool serves: ``POST /v1/completions`` and ``GET /stats`` (the front's own),
    ``GET /v1/models`` (``model``) and ``GET /health``."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    return app
