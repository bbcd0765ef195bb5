"""Redis writes off the request path: an ordered, bounded backlog drained by one task.

While writes fail (Redis away) the writer says so (``failing``), so that readers can skip Redis instead of
waiting on it; the first success after a failure calls ``on_recovered``, which rebuilds in Redis what the
failed writes would have kept there. While they succeed, a ``check`` runs every ``check_interval_s``
between them (whether Redis still holds what was written: it may have lost it without failing a write).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from cache.cancelling import cancel_and_wait

log = logging.getLogger("kvgate.background")

Write = Callable[[], Awaitable[Any]]


class BackgroundWriter:
    """Runs submitted writes one at a time, in order. When the backlog is full (Redis down for long), the
    oldest writes are dropped and counted: every one of them is state the views can rebuild."""

    def __init__(
        self,
        max_backlog: int = 100_000,
        *,
        on_recovered: Callable[[], None] | None = None,
        probe: Write | None = None,
        probe_interval_s: float = 1.0,
        check: Write | None = None,
        check_interval_s: float = 1.0,
    ) -> None:
        self.on_recovered = on_recovered
        self.probe = probe  # a cheap write that succeeds when Redis is back (a PING)
        self.probe_interval_s = probe_interval_s
        self.check = check  # a cheap read, run now and then while writes succeed; a failure counts as one
        self.check_interval_s = check_interval_s
        self._check_due = 0.0
        self.failing = False
        self._backlog: deque[Write] = deque(maxlen=max_backlog)
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.failed = 0
        self._last_warning = 0.0

    def __len__(self) -> int:
        return len(self._backlog)

    def submit(self, write: Write) -> None:
        if len(self._backlog) == self._backlog.maxlen:
            self.dropped += 1
        self._backlog.append(write)
        self._idle.clear()
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            if await self._woken():
                self._wakeup.clear()
                while self._backlog:
                    await self._attempt(self._backlog.popleft())
                self._idle.set()
            elif self.failing and self.probe is not None:
                await self._attempt(self.probe)  # nothing to write: is Redis back?
            if self.check is not None and not self.failing and time.monotonic() >= self._check_due:
                # (also between writes: a steady stream of them must not put the check off for ever)
                self._check_due = time.monotonic() + self.check_interval_s
                await self._attempt(self.check)

    async def _woken(self) -> bool:
        """Wait for a write; False if none came before the probe or the check was due."""
        timeout: float | None = None
        if self.failing and self.probe is not None:
            timeout = self.probe_interval_s
        elif self.check is not None:
            timeout = max(0.0, self._check_due - time.monotonic())
        try:
            async with asyncio.timeout(timeout):
                await self._wakeup.wait()
        except TimeoutError:
            return False
        return True

    async def _attempt(self, write: Write) -> None:
        try:
            await write()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a Redis outage must never stop the writer
            self.failing = True
            self.failed += 1
            now = time.monotonic()
            if now - self._last_warning > 5.0:
                self._last_warning = now
                log.warning("shared-state write failed (%s total): %s", self.failed, exc)
        else:
            if self.failing:
                self.failing = False
                log.warning("shared-state writes succeed again; rebuilding what was missed")
                if self.on_recovered is not None:
                    self.on_recovered()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvgate-redis-writer")

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the backlog is empty; False if it did not empty in time."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    async def stop(self, flush_timeout_s: float = 2.0) -> None:
        if self._task is None:
            return
        await self.flush(flush_timeout_s)
        await cancel_and_wait(self._task)
        self._task = None
