"""kvgate's engine on a tiny model, served in this process on a free port, with a client session to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from engine.llm_engine import EngineConfig, LLMEngine
from engine.server import ENGINE_SERVER, EngineServer, ServerConfig, build_app
from tests.serving import serve


@contextlib.asynccontextmanager
async def served_engine(
    model_dir: Path, **config_fields: Any
) -> AsyncIterator[tuple[EngineServer, str, aiohttp.ClientSession]]:
    """The engine on ``model_dir`` (CPU; ``config_fields`` for the rest of its EngineConfig): its server,
    its URL and a session, until the block ends."""
    engine = LLMEngine(EngineConfig(str(model_dir), device="cpu", **config_fields))
    app = build_app(engine, ServerConfig(engine_id="test/e0"))
    runner = web.AppRunner(app, handler_cancellation=True)
    url = await serve(runner)
    try:
        async with aiohttp.ClientSession() as session:
            yield app[ENGINE_SERVER], url, session
    finally:
        await runner.cleanup()
