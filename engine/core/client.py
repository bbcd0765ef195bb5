"""The API process's handle on an engine core process: the surface of ``AsyncEngine`` that the HTTP server
uses (``generate``, ``embed``, ``start``/``stop``, ``alive``, ``error``, ``load``, ``steps``), over a socket
pair read on the event loop. Every open request fails with ``EngineDead`` when the core's step fails or the
process goes away; a request left early (its client gone, a stop string) is aborted in the core."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import socket
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import numpy as np

from cache.cancelling import cancel_and_wait
from cache.events import KvEvent
from cache.tokens import Tokenizer, load_tokenizer
from engine.async_engine import EngineDead
from engine.core.messages import (
    Abort,
    AddRequest,
    Embed,
    EngineInfo,
    Ready,
    StartupFailed,
    StepBatch,
    receive,
    send,
)
from engine.core.output import RequestOutputs
from engine.core.proc import CoreConfig, run_core
from engine.engine_types import StepOutput
from engine.llm_engine import EngineConfig
from engine.metrics import EngineCounters
from engine.sequence import CacheNamespace, SamplingParams

log = logging.getLogger("kvgate.engine")


class EngineCoreClient:
    """Start one with :meth:`launch` (it waits until the core has loaded the model)."""

    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        info: EngineInfo,
        tokenizer: Tokenizer,
    ) -> None:
        self.process = process
        self.info = info
        self.tokenizer = tokenizer
        self.on_kv_events: Callable[[list[KvEvent]], Any] | None = None
        self.counters = EngineCounters()  # requests and tokens counted here, busy time and pulls the core's
        self.error: BaseException | None = None
        self.failure: str | None = None  # a worker rank of the core's engine died
        self.steps = 0
        self._reader, self._writer = reader, writer
        self._load: dict[str, int] = {}
        self._queues: dict[str, asyncio.Queue[StepOutput | BaseException]] = {}
        self._embeds: dict[str, asyncio.Future[np.ndarray]] = {}
        self._busy = dict.fromkeys(self.counters.busy, 0.0)
        self._reading: asyncio.Task[None] | None = None
        self._stopping = False

    @classmethod
    async def launch(
        cls,
        config: EngineConfig,
        *,
        kv_host: str = "127.0.0.1",
        threads: int | None = None,
        tls_files: tuple[str, str | None] | None = None,
    ) -> EngineCoreClient:
        """Spawn the core (not daemonic: a tp/pp engine spawns workers of its own), load the tokenizer here
        meanwhile, and return once the core is ready; its startup error is raised here."""
        tokenizer = load_tokenizer(config.model_dir)
        ours, theirs = socket.socketpair()
        context = multiprocessing.get_context("spawn")
        process = context.Process(
            target=run_core,
            args=(_core_config(config, kv_host, threads, tls_files), theirs),
            name="kvgate-engine-core",
            daemon=False,
        )
        try:
            process.start()
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        try:
            message = await receive(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            message = StartupFailed(EngineDead("the engine core process exited while starting"))
        except BaseException:
            writer.close()
            await _reap(process)
            raise
        if not isinstance(message, Ready):
            writer.close()
            await _reap(process)
            raise message.error if isinstance(message, StartupFailed) else EngineDead(repr(message))
        client = cls(process, reader, writer, message.info, tokenizer)
        client._reading = asyncio.create_task(client._read())
        return client

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Nothing to start: the core runs since ``launch`` (``AsyncEngine``'s surface)."""

    async def stop(self) -> None:
        """Close the socket (the core stops when it sees that), wait for the process, end it if it lingers."""
        self._stopping = True
        if not self._writer.is_closing():
            self._writer.close()
        await _reap(self.process)
        if self._reading is not None:
            await cancel_and_wait(self._reading)
        self._fail_all(EngineDead("the engine is shutting down"))

    @property
    def alive(self) -> bool:
        return self.error is None and self._reading is not None and not self._reading.done()

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
        """As ``AsyncEngine.generate``: outputs with their text; closing the iterator early aborts the
        request. A request the core rejects raises (RequestRejected, KvTransferError) before any output."""
        if self.error is not None:
            raise EngineDead(f"the engine failed: {self.error}")
        if request_id in self._queues:
            raise EngineDead(f"request id {request_id!r} is already running")
        queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        outputs = RequestOutputs(self.tokenizer, params)
        prompt = list(prompt_token_ids)
        add = AddRequest(
            request_id, prompt, params, namespace or CacheNamespace(), prefill_url, pull_url, pull_tokens
        )
        send(self._writer, add)
        in_core = True  # the core still holds the request: leaving early must abort it there
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    in_core = False
                    raise item
                in_core = not item.finished
                out = outputs.process(item)
                if out is None:
                    continue
                if out.finished:
                    self.counters.finished(out.prompt_tokens, out.cached_tokens, out.completion_tokens)
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if in_core and not self._writer.is_closing():
                send(self._writer, Abort((request_id,)))

    async def embed(
        self, request_id: str, prompt_token_ids: Sequence[int], namespace: CacheNamespace | None = None
    ) -> np.ndarray:
        """As ``AsyncEngine.embed``: the prompt's last hidden state, computed in the core; cancelling the
        wait aborts it there."""
        if self.error is not None:
            raise EngineDead(f"the engine failed: {self.error}")
        if request_id in self._embeds or request_id in self._queues:
            raise EngineDead(f"request id {request_id!r} is already running")
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._embeds[request_id] = future
        send(self._writer, Embed(request_id, list(prompt_token_ids), namespace or CacheNamespace()))
        try:
            return await future
        finally:
            self._embeds.pop(request_id, None)
            if future.cancelled() and not self._writer.is_closing():  # its client left: the core drops it
                send(self._writer, Abort((request_id,)))

    # -- from the core ----------------------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            while True:
                self._apply(await receive(self._reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as exc:  # a message that cannot be read: treat the core as gone
            log.exception("reading the engine core failed")
            self.error = exc
        if self.error is None and self._stopping:
            self.error = EngineDead("the engine is shutting down")
        elif self.error is None:
            code = await asyncio.to_thread(_exit_code, self.process)
            self.error = EngineDead(f"the engine core process exited ({code})")
            log.error("%s", self.error)
        self._fail_all(EngineDead(f"the engine failed: {self.error}"))

    def _apply(self, batch: StepBatch) -> None:
        if batch.events and self.on_kv_events is not None:
            self.on_kv_events(batch.events)
        queues = self._queues
        for out in batch.outputs:
            queue = queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for request_id, hidden in batch.embeddings:
            if (future := self._embeds.get(request_id)) is not None and not future.done():
                future.set_result(hidden)
        for request_id, exc in batch.failures:
            queue = queues.get(request_id)
            if queue is not None:
                queue.put_nowait(exc)
            elif (future := self._embeds.get(request_id)) is not None and not future.done():
                future.set_exception(exc)
        self._load, self.steps, self.failure = batch.load, batch.steps, batch.failure
        if batch.error is not None and self.error is None:
            self.error = EngineDead(batch.error)
        self._count(batch.counters)

    def _count(self, snapshot: dict[str, Any]) -> None:
        counters = self.counters
        for stage, seconds in snapshot["busy"].items():
            counters.busy[stage].add(seconds - self._busy[stage])
            self._busy[stage] = seconds
        counters.kv_pulls.update(snapshot["kv_pulls"])
        counters.kv_pulled_tokens = snapshot["kv_pulled_tokens"]
        counters.kv_pull_served = snapshot["kv_pull_served"]
        counters.kv_pull_served_tokens = snapshot["kv_pull_served_tokens"]

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
        for future in self._embeds.values():
            if not future.done():
                future.set_exception(exc)


def _exit_code(process: multiprocessing.process.BaseProcess) -> str:
    process.join(2.0)
    code = process.exitcode
    return "still running" if code is None else f"signal {-code}" if code < 0 else f"status {code}"


async def _reap(process: multiprocessing.process.BaseProcess, timeout_s: float = 30.0) -> None:
    """Wait for the core to exit; terminate it, then kill it, if it does not."""
    await asyncio.to_thread(process.join, timeout_s)
    for end in (process.terminate, process.kill):
        if process.exitcode is not None:
            return
        end()
        await asyncio.to_thread(process.join, 5.0)


def _core_config(
    config: EngineConfig, kv_host: str, threads: int | None, tls_files: tuple[str, str | None] | None
) -> CoreConfig:
    """The core's configuration; with the API server's (certificate, key) files it serves K/V over https."""
    cert, key = tls_files if tls_files is not None else (None, None)
    return CoreConfig(config, kv_host=kv_host, threads=threads, tls_cert=cert, tls_key=key)
