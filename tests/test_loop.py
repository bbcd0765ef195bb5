"""The suite runs on uvloop (as production does), so loop-specific bugs show up here."""

from __future__ import annotations

import asyncio

import uvloop


async def test_tests_run_on_uvloop() -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
