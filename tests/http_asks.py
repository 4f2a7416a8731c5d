"""An HTTP front asked in a test: an aiohttp app on a free loopback port, a list of requests, every answer."""

import asyncio
from typing import Any


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
