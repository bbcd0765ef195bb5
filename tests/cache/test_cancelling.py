"""Stopping tasks whose libraries drop a cancellation: ``cancel_and_wait`` ends them, and leaves the
caller's own cancellation and the tasks' errors as they were."""

from __future__ import annotations

import asyncio

import pytest

from cache.cancelling import cancel_and_wait


async def test_a_task_that_dropped_a_cancellation_is_cancelled_again() -> None:
    """As Python 3.11's ``asyncio.wait_for`` does (redis-py's sends were under it: gateway.redis_sending)."""
    dropped = 0

    async def drops_the_first() -> None:
        nonlocal dropped
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if dropped:
                    raise
                dropped += 1  # (as wait_for did) and on it goes

    task = asyncio.create_task(drops_the_first())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await cancel_and_wait(task, None, again_after_s=0.05)
    assert task.cancelled() and dropped == 1


async def test_the_callers_own_cancellation_is_not_taken_for_the_tasks() -> None:
    """``with suppress(CancelledError): await task`` swallowed a cancellation of the caller itself."""

    async def slow_to_clean_up() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.shield(asyncio.sleep(0.3))

    task = asyncio.create_task(slow_to_clean_up())
    await asyncio.sleep(0)
    stopping = asyncio.create_task(cancel_and_wait(task))
    await asyncio.sleep(0.05)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    await asyncio.wait({task})
    assert task.cancelled()


async def test_an_error_the_task_ended_with_is_raised() -> None:
    async def fails() -> None:
        raise ValueError("broken")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="broken"):
        await cancel_and_wait(task)
