"""Cancelling tasks and waiting for them to end, when a library inside them may drop the cancellation.

Python 3.11's ``asyncio.wait_for`` drops a cancellation that arrives in the loop turn its awaitable completes
in (CPython gh-86296, mended in 3.12). redis-py sent every command under it, so that ``task.cancel(); await
task`` waited for ever on a task looping on commands (the gateway's client no longer does:
gateway.redis_sending). Any other library may do the same; here a cancellation that did not end a task is
delivered again. It lives in ``cache`` because the gateway, the engines and the region map all stop tasks,
and ``cache`` is what they all import."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

log = logging.getLogger("kvgate.tasks")

AGAIN_AFTER_S = 0.5  # long enough for a task's own clean-up on cancellation (none awaits longer here)


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None, again_after_s: float = AGAIN_AFTER_S) -> None:
    """Cancel each task (``None`` is skipped) and return once all have ended, cancelling again, about every
    ``again_after_s``, any that carried on. A task's own exception, if it ended with one, is raised (as
    ``await task`` would); a cancellation of the caller is the caller's, never taken for the tasks'."""
    pending = {task for task in tasks if task is not None and not task.done()}
    first = True
    while pending:
        for task in pending:
            if not first:
                log.debug("%s carried on after a cancellation: cancelling it again", _name(task))
            task.cancel()
        first = False
        # Waited a random while, a random number of loop turns: a task that loops keeps in step with a
        # fixed period, and each cancellation would then land where the last was dropped.
        _, pending = await asyncio.wait(pending, timeout=again_after_s * (0.5 + random.random()))
        for _ in range(random.randrange(3)):
            await asyncio.sleep(0)
    for ended in tasks:
        if ended is not None and not ended.cancelled() and (error := ended.exception()) is not None:
            raise error


def _name(task: asyncio.Future[Any]) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)
