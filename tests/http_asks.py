"""An HTTP front asked in a test: an aiohttp app on a free loopback port, a list of requests, every answer; and
whether a server started as a user starts it answers ``/health`` yet."""

import asyncio
import urllib.error
import urllib.request
from typing import Any


def health(url: str) -> str | None:
    """None once ``url``'s ``/health`` answers 200, else what it said (a ``ServerProcess`` readiness check)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return None if r.status == 200 else f"/health answered {r.status}"
    except (OSError, urllib.error.URLError) as exc:
        return f"/health: {exc}"


def ask_app(app: Any, asks: list[tuple[str, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """``app`` on a free loopback port: each ``(API key or "", body)`` posted to /v1/completions in turn, then
    ``GET /stats``; every ``(status, JSON answer)``."""
    from aiohttp import ClientSession, web

    async def scenario() -> list[tuple[int, dict[str, Any]]]:
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        out = []
        try:
            async with ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as http:
                for key, body in asks:
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    async with http.post("/v1/completions", json=body, headers=headers) as r:
                        out.append((r.status, await r.json()))
                async with http.get("/stats") as r:
                    out.append((r.status, await r.json()))
        finally:
            await runner.cleanup()
        return out

    return asyncio.run(scenario())
