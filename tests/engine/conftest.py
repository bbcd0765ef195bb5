"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from engine.compress import codec
from engine.sim.server import SIM_ENGINE, SimEngineConfig, build_app
from tests.engine.sim_nodes import BS, Sim, StartSim
from tests.serving import serve


@pytest.fixture
def numpy_path() -> Iterator[None]:
    """The compression codec's numpy reference instead of the native extension, for one test."""
    codec.use_native(False)
    try:
        yield
    finally:
        codec.use_native(True)


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """Starts simulators in-process on free ports; costs default to zero, override per test."""
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(**overrides: Any) -> Sim:
        fields: dict[str, Any] = {
            "engine_id": "sim-test",
            "block_size": BS,
            "prefill_s_per_token": 0.0,
            "decode_s_per_token": 0.0,
        }
        fields.update(overrides)
        app = build_app(SimEngineConfig(**fields))
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        runners.append(runner)
        url = await serve(runner)
        session = aiohttp.ClientSession()
        sessions.append(session)
        return Sim(url, app[SIM_ENGINE], session)

    yield start
    for session in sessions:
        await session.close()
    for runner in runners:
        await runner.cleanup()
