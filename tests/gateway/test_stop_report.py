"""A gateway's stop that is late past its drain says which tasks it still waits on, and where each waits."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from gateway.app import build_app
from gateway.config import parse_config
from gateway.http import server
from gateway.http.server import _say_what_stopping_waits_on


async def test_a_late_stop_names_each_task_it_waits_on_and_its_line(caplog: pytest.LogCaptureFixture) -> None:
    never = asyncio.Event()

    async def inner() -> None:
        await never.wait()  # the line named

    async def follower() -> None:
        await inner()

    task = asyncio.create_task(follower(), name="kvgate-follower")
    await asyncio.sleep(0)
    try:
        with caplog.at_level(logging.WARNING, logger="kvgate.server"):
            _say_what_stopping_waits_on(30.0)
        [message] = [r.getMessage() for r in caplog.records if "still stopping" in r.getMessage()]
        assert "after the drain of 30 s began" in message
        assert "kvgate-follower at " in message
        assert f"{__file__}:{inner.__code__.co_firstlineno + 1}" in message  # (its innermost await)
    finally:
        task.cancel()


async def test_a_stop_done_in_time_says_nothing_though_the_loop_runs_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `kvgate demo` serves the gateway, then stops its engines on the same loop: the late-stop report,
    # timed from the signal, must not fire after a stop that ended in time.
    monkeypatch.setattr(server, "STILL_STOPPING_AFTER_S", 0.2)
    config = {
        "region": "r",
        "regions": [{"name": "r", "engines": [{"name": "e", "url": "http://127.0.0.1:9"}]}],
        "gateway": {"resilience": {"drain_timeout_s": 0}},
    }
    app = build_app(parse_config(config))
    ready = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="kvgate.server"):
        serving = asyncio.create_task(server.serve_until_signal(app, "127.0.0.1", 0, on_ready=ready.set))
        await asyncio.wait_for(ready.wait(), 10)
        os.kill(os.getpid(), signal.SIGTERM)  # (taken by the loop's handler that serve_until_signal set)
        await asyncio.wait_for(serving, 10)
        await asyncio.sleep(0.5)  # past the drain (0 s) and the report's 0.2 s
    assert not [r for r in caplog.records if "still stopping" in r.getMessage()]
