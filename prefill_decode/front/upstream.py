"""The router over engines kvpool did not start: ``kvpool route --upstream URL ...`` in front of OpenAI-compatible
servers (vLLM's ``api_server``, SGLang's ``launch_server``), whatever KV-cache layer they run (kvpool, LMCache,
Mooncake Store, none).  Each ``/v1/completions`` or ``/v1/chat/completions`` request goes to the upstream the policy
picks, its body and headers as the client sent them; the answer comes back as the upstream gives it, a streamed one
chunk by chunk.  ``/metrics`` counts requests, errors and requests in flight per upstream, and how far each request's
prompt matched what its upstream had been sent.

Policies (:class:`Picker`):

- ``round-robin``: each upstream in turn;
- ``least-loaded``: the fewest requests in flight;
- ``prefix-aware``: the upstream that was sent the longest prefix of this prompt, whose own prefix cache likely holds
  it, unless it has ``max_skew`` requests in flight more than the least loaded (then the least loaded): the policy of
  vLLM's production-stack router and of the Mooncake paper's "local cache-aware" scheduler.  Prompts are compared in
  blocks of ``block_chars`` characters, hashed as a chain (a block's hash covers every block before it), each upstream
  remembering the ``capacity`` blocks it was sent last.  It needs no tokenizer, so it routes any model's traffic.
  With ``kv_events`` (``--kv-events tcp://host:port --tokenizer MODEL``) it knows instead of guessing: the engines
  publish what their prefix caches store and evict there, and the prompt's blocks held are counted in the engines'
  own blocks (:mod:`.engine_prefixes`).

An upstream that refuses the connection (a dead or restarting engine) is left out for ``down_s`` and the request,
which it never saw, goes to the next pick; one that fails inside a streamed answer ends that stream with an error
event (``data: {"error": ...}``, as vLLM writes one), not with a second HTTP status on the same connection.

The router holds no KV and asks no engine: with kvpool below the engines, a request any engine takes finds the
pool's chunks wherever they were computed, which is what lets load-only routing keep its hits.
"""

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import ClientConnectorError, ClientError, ClientSession, ClientTimeout, web
from msgspec import Meta

from kvpool.core.config import Config, Rule, validated
from kvpool.errors import ConfigError
from kvpool.prefill_decode.front.engine_prefixes import Asked, EnginePrefixes, tokenizer
from kvpool.prefill_decode.front.openai import error_response

log = logging.getLogger(__name__)

POLICIES = ("round-robin", "least-loaded", "prefix-aware")
#: an upstream: an OpenAI server's base URL
_Url = Annotated[str, Meta(pattern=r"^https?://[^/\s:]+(:\d{1,5})?$", description="http://host:port (a server's URL)")]
#: request headers not passed on (hop-by-hop, or the router's own connection's)
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade"}


class RouteConfig(Config, frozen=True):
    """The router: its upstreams and how it picks among them."""

    upstreams: Annotated[tuple[_Url, ...], Meta(min_length=1, description="at least one --upstream http://host:port")]
    policy: Annotated[Literal["round-robin", "least-loaded", "prefix-aware"], Meta(description=", ".join(POLICIES))]
    block_chars: Annotated[int, Meta(ge=16, description="an int >= 16")] = 256  #: about 64 tokens of English
    capacity: Annotated[int, Meta(ge=1, description="an int >= 1")] = 100_000  #: blocks remembered per upstream
    max_skew: Annotated[int, Meta(ge=0, description="an int >= 0")] = 4  #: prefix-aware: in flight beyond the least
    timeout_s: Annotated[float, Meta(gt=0, description="seconds > 0")] = 600.0  #: one upstream request, end to end
    down_s: Annotated[float, Meta(ge=0, description="seconds >= 0")] = (
        5.0  #: an upstream refusing connections: left out
    )
    #: prefix-aware: where the engines publish their KV events (``tcp://host:port``, bound here; "": none, the
    #: prompts sent stand for what each engine holds), and the model whose tokenizer reads prompts as they do
    kv_events: Annotated[str, Meta(pattern=r"^(tcp://[^\s:]+:\d{1,5})?$", description="tcp://host:port")] = ""
    tokenizer: str = ""

    rules = (Rule("needs", "kv_events", "tokenizer", "give --tokenizer the engines' model directory"),)

    def check(self) -> None:
        if self.kv_events and self.policy != "prefix-aware":
            raise ConfigError(
                f"--kv-events feeds the prefix-aware policy, not {self.policy}: drop it or change --policy"
            )


def prefix_blocks(text: str, block_chars: int) -> list[bytes]:
    """The chain hashes of ``text``'s full blocks of ``block_chars`` characters (a trailing partial block: none)."""
    hashes, h = [], b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = hashlib.blake2b(h + text[start : start + block_chars].encode(), digest_size=16).digest()
        hashes.append(h)
    return hashes


@dataclass
class Upstream:
    url: str
    in_flight: int = 0
    requests: int = 0
    errors: int = 0
    matched_blocks: int = 0  #: of the prompts sent here, blocks it had been sent before
    prompt_blocks: int = 0
    down_until: float = 0.0  #: refused a connection: left out of the picks until then (``time.monotonic()``)
    seen: "OrderedDict[bytes, None]" = field(default_factory=OrderedDict)  #: the blocks sent here, oldest first


class Picker:
    """Which upstream takes a request (see the module's docstring); pure: :meth:`pick` and :meth:`done` bracket it.
    With ``engines``, what each upstream holds of a prompt comes from its engine's KV events (``pick``'s ``tokens``)
    instead of what it was sent."""

    def __init__(self, config: RouteConfig, engines: EnginePrefixes | None = None) -> None:
        self.config, self.engines = config, engines
        self.upstreams = [Upstream(url) for url in config.upstreams]
        self._turn = itertools.cycle(range(len(self.upstreams)))

    def pick(
        self,
        prompt: str,
        now: float = 0.0,
        skip: frozenset[int] = frozenset(),
        asked: Asked | None = None,
    ) -> int:
        """The upstream for a request with ``prompt`` (``asked``, as the engines' blocks compare, where their events
        are followed), counted in flight until :meth:`done`; of those not down at ``now`` (:meth:`down`) and not in
        ``skip`` (every one, if that leaves none)."""
        up_now = [i for i, u in enumerate(self.upstreams) if u.down_until <= now and i not in skip]
        live = up_now or [i for i in range(len(self.upstreams)) if i not in skip] or list(range(len(self.upstreams)))
        blocks: list[bytes] = []
        if self.config.policy != "prefix-aware":
            matched, total = [0] * len(self.upstreams), 0
        elif self.engines is not None:
            matched, total = self.engines.held(asked) if asked else ([0] * len(self.upstreams), 0)
        else:
            blocks = prefix_blocks(prompt, self.config.block_chars)
            matched, total = [self._matched(u, blocks) for u in self.upstreams], len(blocks)
        matched = [m if i in live else 0 for i, m in enumerate(matched)]
        #: ties go to the one that took fewest requests, so light traffic spreads too
        least = min(live, key=lambda i: (self.upstreams[i].in_flight, self.upstreams[i].requests))
        if self.config.policy == "round-robin":
            chosen = next(i for i in self._turn if i in live)
        elif self.config.policy == "least-loaded" or not any(matched):
            chosen = least
        else:
            fair = [
                i for i in live if self.upstreams[i].in_flight <= self.upstreams[least].in_flight + self.config.max_skew
            ]
            chosen = max(fair, key=lambda i: (matched[i], -self.upstreams[i].in_flight, -self.upstreams[i].requests))
        up = self.upstreams[chosen]
        up.in_flight += 1
        up.requests += 1
        up.matched_blocks += matched[chosen]
        up.prompt_blocks += total
        if self.engines is not None and asked is not None:  # held there as soon as computed: until answered, too
            self.engines.sent(chosen, asked)
        for h in blocks:  # its prefix cache holds them now, the newest last
            up.seen[h] = None
            up.seen.move_to_end(h)
        while len(up.seen) > self.config.capacity:
            up.seen.popitem(last=False)
        return chosen

    def done(self, i: int, failed: bool = False, asked: Asked | None = None) -> None:
        self.upstreams[i].in_flight -= 1
        self.upstreams[i].errors += failed
        if self.engines is not None and asked is not None:
            self.engines.answered(i, asked)

    def down(self, i: int, now: float) -> None:
        """Upstream ``i`` refused a connection at ``now``: left out of the picks for ``down_s``."""
        self.upstreams[i].down_until = now + self.config.down_s

    @staticmethod
    def _matched(up: Upstream, blocks: Sequence[bytes]) -> int:
        """How many leading ``blocks`` ``up`` was sent (a chain: the first one missing ends the match)."""
        n = 0
        while n < len(blocks) and blocks[n] in up.seen:
            n += 1
        return n


def prompt_text(body: dict[str, Any]) -> str:
    """The text a request's prefix is: a completion's ``prompt`` (token ids as text), or a chat's messages in order."""
    if "messages" in body:
        messages = body["messages"] if isinstance(body["messages"], list) else []
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages if isinstance(m, dict))
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else msgspec.json.encode(prompt).decode()


class Router:
    """The HTTP side: an aiohttp app passing requests to the picked upstream."""

    def __init__(self, config: RouteConfig) -> None:
        self.config = config
        engines = None
        if config.kv_events:
            tokenize = tokenizer(config.tokenizer)
            engines = EnginePrefixes(config.kv_events, len(config.upstreams), tokenize)
        self.picker = Picker(config, engines)
        self._session: ClientSession | None = None

    async def _client(self) -> ClientSession:
        if self._session is None:
            self._session = ClientSession(timeout=ClientTimeout(total=self.config.timeout_s), auto_decompress=False)
        return self._session

    async def close(self, _: web.Application | None = None) -> None:
        if self._session is not None:
            await self._session.close()
        if self.picker.engines is not None:
            self.picker.engines.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw, type=dict[str, Any])
        except msgspec.DecodeError as exc:  # a ValidationError too: JSON, but not an object
            return error_response(400, f"the body must be a JSON object: {exc}", "invalid_request_error")
        text, asked, engines = prompt_text(body), None, self.picker.engines
        if engines is not None:  # off the event loop: a long prompt takes a while to tokenize
            asked = await asyncio.get_running_loop().run_in_executor(None, engines.asked, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        refused: set[int] = set()
        while True:
            i = self.picker.pick(text, time.monotonic(), frozenset(refused), asked)
            try:
                return await self._pass(request, i, raw, headers, asked)
            except ClientConnectorError as exc:  # it never saw the request: another upstream may take it
                log.warning("upstream %s refused the connection: %s", self.picker.upstreams[i].url, exc)
                self.picker.down(i, time.monotonic())
                refused.add(i)
                if len(refused) == len(self.picker.upstreams):
                    return error_response(502, f"no upstream accepted a connection: {exc}", "server_error")

    async def _pass(
        self, request: web.Request, i: int, raw: bytes, headers: dict[str, str], asked: Asked | None = None
    ) -> web.StreamResponse:
        """The request to upstream ``i``, its answer passed back; ``ClientConnectorError`` if it refused the
        connection (counted as an error there)."""
        url = self.picker.upstreams[i].url + request.rel_url.path_qs
        failed, answer = True, None
        try:
            session = await self._client()
            async with session.post(url, data=raw, headers=headers) as upstream:
                answer = web.StreamResponse(status=upstream.status, headers=_passed(upstream.headers))
                answer.headers["x-kvpool-upstream"] = str(i)
                await answer.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await answer.write(chunk)
                await answer.write_eof()
                failed = upstream.status >= 500
                return answer
        except ClientConnectorError:
            raise
        except (TimeoutError, ClientError) as exc:
            log.warning("upstream %s failed: %s", url, exc)
            why = f"upstream {self.picker.upstreams[i].url} failed: {exc}"
            if answer is None or not answer.prepared:
                return error_response(502, why, "server_error")
            # the status went out already: end the stream with an error event, as vLLM ends one
            error = {"error": {"message": why, "type": "server_error", "code": 502}}
            with contextlib.suppress(ConnectionError):
                await answer.write(b"data: " + msgspec.json.encode(error) + b"\n\n")
                await answer.write_eof()
            return answer
        finally:
            self.picker.done(i, failed, asked)

    async def models(self, _: web.Request) -> web.Response:
        session = await self._client()
        for up in self.picker.upstreams:
            try:
                async with session.get(up.url + "/v1/models") as got:
                    if got.status == 200:
                        return web.json_response(await got.json())
            except (TimeoutError, ClientError):
                continue
        return error_response(502, "no upstream answered /v1/models", "server_error")

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "upstreams": len(self.picker.upstreams)})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=render_metrics(self.picker), content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.forward)
        app.router.add_post("/v1/chat/completions", self.forward)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_cleanup.append(self.close)
        return app


def _passed(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP | {"content-encoding"}}


#: what /metrics says of each upstream: (metric, kind, help, the Upstream field)
METRICS = (
    ("requests_total", "counter", "requests passed to the upstream", "requests"),
    ("errors_total", "counter", "requests that failed there (a 5xx, or no answer)", "errors"),
    ("in_flight", "gauge", "requests passed and not answered yet", "in_flight"),
    (
        "prompt_blocks_total",
        "counter",
        "prompt blocks of the requests (prefix-aware only; the engines' KV blocks with --kv-events)",
        "prompt_blocks",
    ),
    (
        "matched_blocks_total",
        "counter",
        "of those, blocks the upstream had been sent before (with --kv-events: its engine held)",
        "matched_blocks",
    ),
)


def render_metrics(picker: Picker) -> str:
    """Prometheus text: per upstream, requests, errors, in flight, and prompt blocks sent and matched; with the
    engines' KV events followed, the events applied and the gaps in their sequence."""
    lines, policy = [], picker.config.policy
    for name, kind, what, attr in METRICS:
        lines += [f"# HELP kvpool_route_{name} {what}", f"# TYPE kvpool_route_{name} {kind}"]
        for up in picker.upstreams:
            lines.append(f'kvpool_route_{name}{{upstream="{up.url}",policy="{policy}"}} {getattr(up, attr)}')
    if picker.engines is not None:
        events = picker.engines.events
        for name, what, n in (
            ("kv_events_total", "the engines' KV events applied", events.events),
            ("kv_event_gaps_total", "gaps in an engine's event sequence (each emptied its index)", events.gaps),
        ):
            lines += [f"# HELP kvpool_route_{name} {what}", f"# TYPE kvpool_route_{name} counter"]
            lines.append(f'kvpool_route_{name}{{policy="{policy}"}} {n}')
    return "\n".join(lines) + "\n"


def route_config(upstreams: Sequence[str], policy: str, **settings: Any) -> RouteConfig:
    """``kvpool route``'s options as a config, or one ``ConfigError`` saying what is wrong."""
    urls = tuple(dict.fromkeys(u.rstrip("/") for u in upstreams))  # one server named twice is one upstream
    return validated(RouteConfig, {"upstreams": urls, "policy": policy, **settings}, "kvpool route")
