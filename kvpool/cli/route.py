"""``kvpool route``: the router in front of OpenAI-compatible engines kvpool did not start
(:mod:`~kvpool.prefill_decode.front.upstream`), in the foreground until Ctrl-C."""

import typer

from kvpool.cli import root
from kvpool.core.config import default_of
from kvpool.prefill_decode.front.upstream import RouteConfig

POLICY_HELP = (
    "round-robin (each in turn), least-loaded (the fewest requests in flight) or prefix-aware (the engine that was "
    "sent the longest prefix of the prompt, unless it is --max-skew requests busier than the least loaded)."
)
KV_EVENTS_HELP = (
    "prefix-aware: tcp://host:port the router binds for the engines' KV events (vLLM's --kv-events-config, printed "
    "per engine at start), so it knows what each engine's prefix cache holds instead of guessing from what it was "
    "sent. Needs --tokenizer."
)
TOKENIZER_HELP = (
    "With --kv-events: the engines' model directory (or a name already downloaded), to read prompts as they do."
)


@root.app.command("route")
def route(
    upstreams: list[str] = typer.Option(
        [],
        "--upstream",
        help="An engine's OpenAI server, http://host:port (vLLM's api_server, SGLang's launch_server); once per "
        "engine.",
        show_default=False,
    ),
    policy: str = typer.Option("prefix-aware", "--policy", help=POLICY_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Where the router listens (0.0.0.0: every address)."),
    port: int = typer.Option(8000, "--port", help="Its port."),
    block_chars: int = typer.Option(
        default_of(RouteConfig, "block_chars"), "--block-chars", help="prefix-aware: characters of a prompt block."
    ),
    max_skew: int = typer.Option(
        default_of(RouteConfig, "max_skew"),
        "--max-skew",
        help="prefix-aware: requests in flight beyond the least loaded.",
    ),
    down_s: float = typer.Option(
        default_of(RouteConfig, "down_s"),
        "--down-s",
        help="Seconds an engine that refused a connection is left out (its request goes to another at once).",
    ),
    kv_events: str = typer.Option("", "--kv-events", help=KV_EVENTS_HELP, show_default=False),
    tokenizer: str = typer.Option("", "--tokenizer", help=TOKENIZER_HELP, show_default=False),
) -> None:
    """Route OpenAI requests (/v1/completions, /v1/chat/completions) over engines you started, streamed answers
    passed through as they come; /metrics counts requests, errors and prefix matches per engine.

    Example: kvpool route --upstream http://127.0.0.2:8001 --upstream http://127.0.0.3:8001 --policy round-robin.
    With kvpool below the engines, any engine finds the pool's chunks, so load-only routing keeps its hits.
    Prefix-aware from the engines' own KV events: add --kv-events tcp://127.0.0.1:5557 --tokenizer MODEL_DIR and
    start each engine with the --kv-events-config the router prints for it.
    """
    from aiohttp import web

    from kvpool.prefill_decode.front.upstream import Router, route_config

    with root.errors():
        settings = {"block_chars": block_chars, "max_skew": max_skew, "down_s": down_s}
        config = route_config(upstreams, policy, kv_events=kv_events, tokenizer=tokenizer, **settings)
        router = Router(config)
        _announce(config, f"http://{host}:{port}")
        web.run_app(router.app(), host=host, port=port, print=lambda _: None)  # it stops on Ctrl-C and kill


def _announce(config: RouteConfig, where: str) -> None:
    """Where the router listens, and with --kv-events the flag each engine publishes its events with."""
    from kvpool.prefill_decode.front.engine_prefixes import events_flag

    root.console.print(
        f"routing   {where}/v1/completions over {len(config.upstreams)} engine(s), {config.policy}; "
        f"{where}/metrics (Ctrl-C stops)",
        soft_wrap=True,
    )
    for i, url in enumerate(config.upstreams if config.kv_events else ()):
        root.console.print(f"engine {i}  {url} publishes with {events_flag(config.kv_events, i)}", soft_wrap=True)
