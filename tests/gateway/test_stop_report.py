"""A gateway's stop that is late past its drain says which tasks it still waits on, and where each waits."""

from __future__ import annotations

import asyncio
import logging

import pytest

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
