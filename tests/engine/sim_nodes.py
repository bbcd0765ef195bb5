"""The simulated engine over real HTTP for the tests: a started simulator and a client session to ask it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from engine.sim.server import SimEngine

BS = 16


@dataclasses.dataclass
class Sim:
    url: str
    engine: SimEngine
    session: aiohttp.ClientSession

    async def post(self, path: str, body: Any, **kwargs: Any) -> tuple[int, Any, aiohttp.ClientResponse]:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        async with self.session.post(f"{self.url}{path}", data=data, **kwargs) as resp:
            raw = await resp.read()
        return resp.status, orjson.loads(raw), resp

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        status, payload, _ = await self.post("/v1/completions", body)
        assert status == 200, payload
        return payload  # type: ignore[no-any-return]

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        status, payload, _ = await self.post("/v1/chat/completions", body)
        assert status == 200, payload
        return payload  # type: ignore[no-any-return]

    async def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        """Every SSE event's payload: dicts, then the string "[DONE]"."""
        async with self.session.post(
            f"{self.url}{path}", data=orjson.dumps({**body, "stream": True})
        ) as resp:
            assert resp.status == 200
            assert resp.content_type == "text/event-stream"
            text = (await resp.read()).decode()
        assert text.endswith("\n\n")
        events = []
        for block in text.split("\n\n")[:-1]:
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else orjson.loads(data))
        return events

    async def health(self) -> dict[str, Any]:
        async with self.session.get(f"{self.url}/health") as resp:
            assert resp.status == 200
            return await resp.json()  # type: ignore[no-any-return]


StartSim = Callable[..., Awaitable[Sim]]


async def wait_for(predicate: Callable[[], Awaitable[bool]], within: float = 3.0) -> None:
    async with asyncio.timeout(within):
        # Polling /health: the state is another component's, reachable only over HTTP.
        while not await predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


def text_of(n_bytes: int, salt: str = "") -> str:
    """ASCII text of exactly ``n_bytes`` bytes (so exactly that many byte tokens)."""
    base = f"{salt}The quick brown fox jumps over the lazy dog. " * (n_bytes // 40 + 2)
    return base[:n_bytes]
