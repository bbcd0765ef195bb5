"""The engine's step loop on a thread of its own, with an asyncio face for the HTTP server.

Model steps are long and hold the CPU (torch releases the GIL inside its kernels), so they must not run on
the event loop. Requests cross to the engine thread through a locked queue; outputs and KV events come
back with ``call_soon_threadsafe``. A step that raises marks the engine dead: every open request fails
cleanly and ``/health`` turns red.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from cache.events import KvEvent
from engine.llm_engine import LLMEngine, StepOutput
from engine.sequence import SamplingParams

log = logging.getLogger("kvgate.engine")


class EngineDead(RuntimeError):
    """The step loop failed; the engine serves nothing more."""


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, *, on_kv_events: Callable[[list[KvEvent]], Any] | None = None
    ) -> None:
        self.engine = engine
        self._on_kv_events = on_kv_events
        self._commands: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[StepOutput | BaseException]] = {}
        self.error: BaseException | None = None
        self.steps = 0
        self._load = engine.load()

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def load(self) -> dict[str, int]:
        return self._load

    # -- requests ---------------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str = ""
    ) -> AsyncIterator[StepOutput]:
        """Outputs of one request as they are produced. Closing the iterator early aborts the request."""
        if self.error is not None:
            raise EngineDead(f"the engine failed: {self.error}")
        self.engine.check_request(prompt_token_ids, params)  # RequestRejected, before anything is queued
        queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self._submit(("add", request_id, list(prompt_token_ids), params, cache_salt))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    def _submit(self, command: tuple[Any, ...]) -> None:
        self._commands.append(command)
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            while self._commands:
                command = self._commands.popleft()
                try:
                    if command[0] == "add":
                        engine.add_request(*command[1:])
                    else:
                        engine.abort(command[1])
                except Exception as exc:  # a request that cannot be added fails alone
                    self._post(self._fail_one, command[1], exc)
            if not engine.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:  # the model broke: fail everything, stop stepping
                log.exception("engine step failed")
                self.error = exc
                self._post(self._fail_all, EngineDead(f"the engine failed: {exc}"))
                return
            self.steps += 1
            self._load = engine.load()
            events = engine.blocks.drain_events()
            self._post(self._deliver, outputs, events)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is left to tell
            self._loop.call_soon_threadsafe(callback, *args)

    # -- back on the event loop -------------------------------------------------------------------------

    def _deliver(self, outputs: list[StepOutput], events: list[KvEvent]) -> None:
        if events and self._on_kv_events is not None:
            self._on_kv_events(events)
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_one(self, request_id: str, exc: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
