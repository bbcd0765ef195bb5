"""One task in flight per key: concurrent callers for the same key await the same work instead of each
starting their own (a key's store read, a rate-limit bucket's refill)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    def __init__(self) -> None:
        self._tasks: dict[K, asyncio.Task[V]] = {}

    async def run(self, key: K, work: Callable[[], Coroutine[Any, Any, V]]) -> V:
        """The result of ``key``'s work in flight, or of ``work()`` started now. Shielded: a caller
        cancelled while waiting does not cancel the work the others wait for."""
        task = self._tasks.get(key)
        if task is None or task.done():
            task = self._tasks[key] = asyncio.get_running_loop().create_task(work())
            task.add_done_callback(lambda done: self._finished(key, done))
        return await asyncio.shield(task)

    def _finished(self, key: K, task: asyncio.Task[V]) -> None:
        # Gone before its waiters wake (their callbacks come after this one): one that must go again
        # starts new work.
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled():
            task.exception()  # seen: its waiters may all have been cancelled
