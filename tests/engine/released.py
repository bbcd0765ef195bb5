"""That an in-process engine gave everything back once its requests ended (a client left, a batch aborted):
no work left, every KV block free, and its ``/health`` load saying so."""

from __future__ import annotations

import asyncio

import aiohttp

from engine.llm_engine import LLMEngine


async def assert_released(
    llm: LLMEngine, session: aiohttp.ClientSession, url: str, *, polls: int = 200
) -> None:
    """Wait (``polls`` x 20 ms at most) for ``llm`` to have no work, then check what it holds and reports."""
    for _ in range(polls):
        if not llm.scheduler.has_work():
            break
        await asyncio.sleep(0.02)
    assert not llm.scheduler.has_work()
    assert llm.blocks.num_free == llm.blocks.num_blocks
    async with session.get(url + "/health") as r:
        load = (await r.json())["load"]
    assert load["running"] == 0 and load["kv_blocks_free"] == llm.blocks.num_blocks  # no stale load
