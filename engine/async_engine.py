"""The engine's step loop on a thread of its own, with an asyncio face for the HTTP server.

Model steps are long and hold the CPU (torch releases the GIL inside its kernels), so they must not run on
the event loop. Requests cross to the engine thread through a locked queue; outputs, KV events and KV
transfer work come back with ``call_soon_threadsafe``. A step that raises marks the engine dead: every open
request fails cleanly and ``/health`` turns red.

Disaggregation: a request with a ``prefill_url`` is admitted holding blocks for its prompt, then its K/V is
pulled from that prefill engine (``kv_fetcher``, which reads and stores it off the event loop) while other
sequences keep stepping; ``export`` is the prefill engine's side, yielding K/V frames as the layers of its
prefill finish, at most ``kv_send_window`` of them staged at once. A request whose K/V is still arriving is
aborted only once the fetch has stopped writing into its blocks (they go back to the pool at the abort).

KV pull: a request with a ``pull_url`` is admitted the same way, but the positions it lacks come from that
peer's prefix cache (``export_cached`` is the peer's side, served between two steps without queueing), as
many as the peer still holds; a pull that fails costs the request nothing but the time: it computes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Protocol

import numpy as np

from cache.events import KvEvent
from engine.embedding import EmbedQueue
from engine.engine_types import ImportTicket, StepOutput
from engine.kv_export import ExportSink, PinnedRun
from engine.kv_send import vectored_writes
from engine.kv_staging import SendWindow
from engine.kv_transfer import KvTransferError, StagedFrame
from engine.llm_engine import LLMEngine
from engine.sequence import CacheNamespace, SamplingParams

log = logging.getLogger("kvgate.engine")


class KvFetcher(Protocol):
    """Fetches a ticket's K/V into its blocks (``engine.kv_import.KvImporter``); raises KvTransferError."""

    async def __call__(self, ticket: ImportTicket, source_url: str, namespace: CacheNamespace) -> int:
        """From a prefill engine; returns the tokens it found in its own cache."""
        ...

    async def pull(self, ticket: ImportTicket, source_url: str, namespace: CacheNamespace) -> int:
        """From a peer's prefix cache; returns the end of the positions stored (``ticket.start`` on)."""
        ...


async def _staged(run: PinnedRun) -> AsyncGenerator[StagedFrame, None]:
    """The frames of a pinned run, each staged on a worker thread while the one before is written (a
    gather, or on a GPU queueing its copies: never on the event loop). Closing the iterator closes the run
    and releases the frame staged ahead, now or once its worker is done."""
    loop = asyncio.get_running_loop()
    run.vectored = vectored_writes(loop)  # then a frame may be many runs of the cache's own memory
    ahead = loop.run_in_executor(None, run.next_frame)
    try:
        while (frame := await asyncio.shield(ahead)) is not None:
            ahead = loop.run_in_executor(None, run.next_frame)
            yield frame
    finally:
        run.close()
        ahead.add_done_callback(_release_staged)


def _release_staged(ahead: asyncio.Future[StagedFrame | None]) -> None:
    if not ahead.cancelled() and ahead.exception() is None and (frame := ahead.result()) is not None:
        frame.release()


class EngineDead(RuntimeError):
    """The step loop failed; the engine serves nothing more."""


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        on_kv_events: Callable[[list[KvEvent]], Any] | None = None,
        kv_fetcher: KvFetcher | None = None,
        kv_send_window: int = 8,
        on_step: Callable[[], Any] | None = None,
    ) -> None:
        """``on_step`` is called on the loop once per step, after that step's outputs are queued (an engine
        core gathers them into one message with it: ``engine.core``)."""
        self.engine = engine
        self._on_kv_events = on_kv_events
        self._on_step = on_step
        self._kv_fetcher = kv_fetcher
        self.kv_send_window = kv_send_window  # staged K/V frames of one export in flight at most
        self._commands: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._import_sources: dict[str, tuple[str, CacheNamespace]] = {}  # request id -> (source url, ...)
        self._imports: dict[str, asyncio.Task[None]] = {}
        self._windows: set[SendWindow] = set()  # of the exports in flight
        self.embeds = EmbedQueue()  # /v1/embeddings prompts, run between steps (engine.embedding)
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
        for window in list(self._windows):  # a step waiting for room in one must not outlive the loop
            window.close()
        for task in list(self._imports.values()):
            task.cancel()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        self.embeds.fail_all(EngineDead("the engine is shutting down"))

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def load(self) -> dict[str, int]:
        return self._load

    # -- requests ---------------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        namespace: CacheNamespace | None = None,
        *,
        prefill_url: str | None = None,
        pull_url: str | None = None,
        pull_tokens: int = 0,
    ) -> AsyncGenerator[StepOutput, None]:
        """Outputs of one request as they are produced. Closing the iterator early aborts the request.
        With ``prefill_url`` the prompt's K/V is pulled from that prefill engine instead of computed here;
        a failed transfer raises KvTransferError before any output. With ``pull_url`` the K/V of up to
        ``pull_tokens`` leading prompt tokens that its own cache lacks is pulled from that peer's prefix
        cache; whatever the pull does not bring (it failed, the peer evicted some) is computed here."""
        if self.error is not None:
            raise EngineDead(f"the engine failed: {self.error}")
        self.engine.check_request(prompt_token_ids, params)  # RequestRejected, before anything is queued
        if prefill_url is not None and self._kv_fetcher is None:
            raise KvTransferError("this engine cannot receive KV transfers")
        queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        namespace = namespace or CacheNamespace()
        source = prefill_url or pull_url
        if source is not None:
            self._import_sources[request_id] = (source, namespace)
        pull = pull_tokens if pull_url is not None else None
        self._submit(
            ("add", request_id, list(prompt_token_ids), params, namespace, prefill_url is not None, pull)
        )
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
            self._import_sources.pop(request_id, None)
            task = self._imports.pop(request_id, None)
            if task is not None and not task.done():
                task.cancel()
                if not finished:  # the blocks go back to the pool once the fetch stopped writing them
                    task.add_done_callback(lambda _: self._submit(("abort", request_id)))
            elif not finished:
                self._submit(("abort", request_id))

    async def embed(
        self, request_id: str, prompt_token_ids: Sequence[int], namespace: CacheNamespace | None = None
    ) -> np.ndarray:
        """The last hidden state of a prompt (float32 [hidden]), computed between two steps; RequestRejected
        for one the engine could never serve. Cancelling it drops a prompt not yet started."""
        if self.error is not None:
            raise EngineDead(f"the engine failed: {self.error}")
        prompt, namespace = list(prompt_token_ids), namespace or CacheNamespace()
        return await self.embeds.embed(self.engine, request_id, prompt, namespace, self._wake)

    def export(
        self, request_id: str, prompt_token_ids: Sequence[int], namespace: CacheNamespace, from_position: int
    ) -> AsyncGenerator[StagedFrame, None]:
        """Prefill a prompt here and yield its K/V frames (positions ``from_position`` on) as its layers
        finish, then the closing frame. Closing the iterator early aborts the prefill."""
        if self.error is not None:
            raise EngineDead(f"the engine failed: {self.error}")
        prompt = list(prompt_token_ids)
        self.engine.check_request(prompt, SamplingParams(max_tokens=0))
        return self._frames(
            request_id, lambda sink: ("export", request_id, prompt, namespace, from_position, sink)
        )

    def export_cached(
        self, request_id: str, prompt_token_ids: Sequence[int], namespace: CacheNamespace, from_position: int
    ) -> AsyncGenerator[StagedFrame, None]:
        """Serve a peer's KV pull: yield the frames of the positions ``from_position`` on that this engine's
        prefix cache holds, then the closing frame (``LLMEngine.export_cached``). It goes through the
        command queue only, never the scheduler's: it is served before the next step, however many
        requests wait there."""
        if self.error is not None:
            raise EngineDead(f"the engine failed: {self.error}")
        prompt = list(prompt_token_ids)
        return self._frames(
            request_id, lambda sink: ("export_cached", request_id, prompt, namespace, from_position, sink)
        )

    async def _frames(
        self, request_id: str, command: Callable[[ExportSink], tuple[Any, ...]]
    ) -> AsyncGenerator[StagedFrame, None]:
        """Submit ``command(sink)`` and yield the frames its sink sends from the engine thread, up to and
        including the closing one; whoever writes a frame releases it once written, making room in the
        sink's window. Cached positions come as a pinned run, staged here frame by frame as they are
        written. Closing the iterator early aborts the request and releases what it held: the window closes
        (the engine stops staging for it), the frames not yet yielded go back, and so do pinned blocks."""
        queue: asyncio.Queue[StagedFrame | PinnedRun | BaseException | None] = asyncio.Queue()
        window = SendWindow(self.kv_send_window)
        self._windows.add(window)
        post = self._post

        def deliver(item: StagedFrame | PinnedRun) -> None:  # on the loop
            if not window.closed:
                queue.put_nowait(item)
            elif isinstance(item, PinnedRun):
                item.close()  # nobody is left to write it
            else:
                item.release()

        def send(item: StagedFrame | PinnedRun) -> None:  # on the engine thread
            post(deliver, item)

        def close(header: dict[str, Any]) -> None:  # on the engine thread
            post(queue.put_nowait, StagedFrame.of(header))
            post(queue.put_nowait, None)

        def wake() -> None:  # a pinned run's blocks may go back: any thread
            self._submit(("kv_unpin", ""))

        self._queues[request_id] = queue  # an engine failure reaches it like any other request
        self._submit(command(ExportSink(send, close, window, send_run=send, wake=wake)))
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is None:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, StagedFrame):
                    yield item
                    continue
                async with contextlib.aclosing(_staged(item)) as frames:  # closed with this one
                    async for frame in frames:
                        yield frame
        finally:
            window.close()
            self._windows.discard(window)
            while not queue.empty():
                left = queue.get_nowait()
                if isinstance(left, PinnedRun):
                    left.close()
                elif isinstance(left, StagedFrame):
                    left.release()
            self._queues.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    def _submit(self, command: tuple[Any, ...]) -> None:
        self._commands.append(command)
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            engine.warm_up()  # here: the memory it maps is this thread's arena
        except Exception:
            log.exception("warming the engine up failed")  # the steps will say whether the model works
        while not self._stopping:
            had_commands = bool(self._commands)
            while self._commands:
                command = self._commands.popleft()
                try:
                    self._execute(command)
                except Exception as exc:  # a request that cannot be added fails alone
                    self._post(self._fail_one, command[1], exc)
            if had_commands:
                self._load = engine.load()  # aborts free blocks without a step: /health must say so
            if self.embeds:
                self.embeds.run(engine)  # first dibs on the blocks the last step freed, before admissions
            if not engine.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:  # the model broke: fail everything, stop stepping
                log.exception("engine step failed")
                self.error = exc
                self.embeds.fail_all(EngineDead(f"the engine failed: {exc}"))
                self._post(self._fail_all, EngineDead(f"the engine failed: {exc}"))
                return
            self.steps += 1
            self._load = engine.load()
            events = engine.blocks.drain_events()
            tickets = engine.take_import_tickets()
            self._post(self._deliver, outputs, events, tickets)
            if engine.idle:
                # All that is left waits on transfers (or on blocks they hold): wait for news, don't spin.
                self._wake.wait(0.01)
                self._wake.clear()

    def _execute(self, command: tuple[Any, ...]) -> None:
        engine, kind = self.engine, command[0]
        if kind == "add":
            _, request_id, prompt, params, namespace, import_kv, pull_tokens = command
            engine.add_request(
                request_id, prompt, params, namespace, import_kv=import_kv, pull_tokens=pull_tokens
            )
        elif kind == "export":
            engine.add_export(*command[1:])
        elif kind == "export_cached":
            engine.export_cached(*command[2:])  # served now, between two steps: it computes nothing
        elif kind == "kv_unpin":
            engine.run_kv_unpins()
        elif kind == "imported":
            engine.finish_import(command[1], command[2])
        elif kind == "pulled":
            engine.finish_pull(command[1], command[2])
        elif kind == "import_failed":
            engine.abort(command[1])  # frees the blocks it reserved
            self._post(self._fail_one, command[1], KvTransferError(command[2]))
        else:
            engine.abort(command[1])

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is left to tell
            self._loop.call_soon_threadsafe(callback, *args)

    # -- back on the event loop -------------------------------------------------------------------------

    def _deliver(self, outputs: list[StepOutput], events: list[KvEvent], tickets: list[ImportTicket]) -> None:
        if events and self._on_kv_events is not None:
            self._on_kv_events(events)
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for ticket in tickets:
            source = self._import_sources.pop(ticket.request_id, None)
            if source is None:  # its client already left; the abort is on its way
                continue
            fetch = self._pull if ticket.pull else self._import
            self._imports[ticket.request_id] = asyncio.create_task(fetch(ticket, *source))
        if self._on_step is not None:
            self._on_step()

    async def _import(self, ticket: ImportTicket, prefill_url: str, namespace: CacheNamespace) -> None:
        assert self._kv_fetcher is not None
        try:
            cached = await self._kv_fetcher(ticket, prefill_url, namespace)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("KV transfer for %s failed: %s", ticket.request_id, exc)
            self._submit(("import_failed", ticket.request_id, str(exc)))
        else:
            self._submit(("imported", ticket.request_id, cached))
        finally:
            self._imports.pop(ticket.request_id, None)

    async def _pull(self, ticket: ImportTicket, pull_url: str, namespace: CacheNamespace) -> None:
        pulled_to: int | None = None  # a failed pull: the request computes those positions itself
        try:
            if self._kv_fetcher is None:
                raise KvTransferError("this engine cannot receive KV transfers")
            pulled_to = await self._kv_fetcher.pull(ticket, pull_url, namespace)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "KV pull for %s from %s failed, computing it here: %s", ticket.request_id, pull_url, exc
            )
        finally:
            self._imports.pop(ticket.request_id, None)
        self._submit(("pulled", ticket.request_id, pulled_to))

    def _fail_one(self, request_id: str, exc: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
