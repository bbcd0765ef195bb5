"""The engine core process: the LLMEngine and its step loop (``engine.async_engine``, with disaggregation
and KV pulls as they are in one process), fed by the API process over a socket pair. Each step's outputs
(token ids), KV events and load go back as one :class:`~engine.core.messages.StepBatch`. The K/V cache is
here, so the KV source routes are served here too, on a port of the core's own. The core exits when the API
process closes its end of the socket, or dies: it is never left behind."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import signal
import socket
import ssl
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from cache.parent_death import die_with_parent
from engine.async_engine import AsyncEngine
from engine.core.messages import (
    Abort,
    AddRequest,
    Embed,
    EngineInfo,
    Ready,
    StartupFailed,
    StepBatch,
    portable,
    receive,
    send,
)
from engine.kv_import import KvImporter
from engine.kv_serve import MAX_BODY_BYTES, serve_kv_source
from engine.llm_engine import EngineConfig, LLMEngine
from engine.metrics import EngineCounters


@dataclass(frozen=True)
class CoreConfig:
    engine: EngineConfig
    kv_host: str = "127.0.0.1"  # where the core serves the KV source routes (the API server's address)
    threads: int | None = None  # torch's CPU threads
    heartbeat_s: float = 0.05  # between steps, load changes (an abort's freed blocks) go out this often
    # The API server's --tls-cert and --tls-key: K/V is served over https as the API is (an SSLContext
    # does not cross to a spawned process; the files do).
    tls_cert: str | None = None
    tls_key: str | None = None

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls_cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        return context


def run_core(config: CoreConfig, sock: socket.socket) -> None:
    """The spawned process's entry point: load the engine, serve the API process until it goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the API process, which stops the core
    die_with_parent()  # loading a model takes minutes: the socket's EOF is read only once it is done
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    loop_factory: Any = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_main(config, sock))


async def _main(config: CoreConfig, sock: socket.socket) -> None:
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        llm = LLMEngine(config.engine, detokenize=False)
    except BaseException as exc:  # the API process says why (the CLI's errors: model, tokenizer, sizing...)
        send(writer, StartupFailed(_picklable(exc)))
        await writer.drain()
        writer.close()
        return
    try:
        await EngineCore(llm, reader, writer, config).run()
    finally:
        llm.close()  # a tp/pp engine's worker processes


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class EngineCore:
    """Requests from the API process become ``AsyncEngine.generate`` tasks; what they yield is gathered and
    sent once per step (``on_step``), failures and load changes as soon as they happen."""

    def __init__(
        self, llm: LLMEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, config: CoreConfig
    ) -> None:
        self.llm = llm
        self.config = config
        self._reader, self._writer = reader, writer
        self.importer = KvImporter(llm.kv_cache, llm.model_name) if llm.kv_cache is not None else None
        self.engine = AsyncEngine(
            llm, on_kv_events=self._batch_events, kv_fetcher=self.importer, on_step=self._soon
        )
        self._batch = StepBatch()
        self._flush_queued = False
        self._sent: tuple[Any, ...] = ()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        self.engine.start()
        kv_runner, kv_port = await self._serve_kv()
        info = EngineInfo.of(self.llm, kv_port=kv_port, kv_tls=self.config.tls_cert is not None)
        send(self._writer, Ready(info))
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            while True:
                try:
                    message = await receive(self._reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the API process closed its end, or is gone
                if isinstance(message, AddRequest):
                    self._tasks[message.request_id] = asyncio.create_task(self._serve(message))
                elif isinstance(message, Embed):
                    self._tasks[message.request_id] = asyncio.create_task(self._embed(message))
                elif isinstance(message, Abort):
                    for request_id in message.request_ids:
                        task = self._tasks.pop(request_id, None)
                        if task is not None:
                            task.cancel()  # the generator's exit aborts the sequence
        finally:
            heartbeat.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.engine.stop()
            await kv_runner.cleanup()
            if self.importer is not None:
                await self.importer.close()
            self._writer.close()

    async def _serve(self, add: AddRequest) -> None:
        try:
            async for out in self.engine.generate(
                add.request_id,
                add.prompt_token_ids,
                add.params,
                add.namespace,
                prefill_url=add.prefill_url,
                pull_url=add.pull_url,
                pull_tokens=add.pull_tokens,
            ):
                self._batch.outputs.append(out)
        except asyncio.CancelledError:
            pass  # aborted by the API process (a client gone, a stop string): nothing to tell it
        except Exception as exc:
            self._batch.failures.append((add.request_id, portable(exc)))
            self._soon()
        finally:
            if self._tasks.get(add.request_id) is asyncio.current_task():
                del self._tasks[add.request_id]

    async def _embed(self, embed: Embed) -> None:
        try:
            hidden = await self.engine.embed(embed.request_id, embed.prompt_token_ids, embed.namespace)
            self._batch.embeddings.append((embed.request_id, hidden))
        except asyncio.CancelledError:
            return  # aborted by the API process: its client left
        except Exception as exc:
            self._batch.failures.append((embed.request_id, portable(exc)))
        finally:
            if self._tasks.get(embed.request_id) is asyncio.current_task():
                del self._tasks[embed.request_id]
        self._soon()  # no step need follow an embedding: send it now

    # -- to the API process ---------------------------------------------------------------------------

    def _batch_events(self, events: list[Any]) -> None:
        self._batch.events.extend(events)

    def _soon(self) -> None:
        """Flush once the tasks woken by this step's outputs have queued them (they run first)."""
        if not self._flush_queued:
            self._flush_queued = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _state(self) -> tuple[Any, ...]:
        error, failure = self.engine.error, self.llm.failure
        return (
            self.engine.load(),
            None if error is None else str(error),
            None if failure is None else str(failure),
        )

    def _flush(self) -> None:
        self._flush_queued = False
        batch, self._batch = self._batch, StepBatch()
        self._sent = (batch.load, batch.error, batch.failure) = self._state()
        batch.steps = self.engine.steps
        batch.counters = counter_snapshot(self.llm.counters)
        send(self._writer, batch)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            batch = self._batch
            news = batch.outputs or batch.embeddings or batch.failures or batch.events
            if news or self._state() != self._sent:
                self._flush()

    # -- the KV source routes ------------------------------------------------------------------------------

    async def _serve_kv(self) -> tuple[web.AppRunner, int]:
        model, block_size, engine = self.llm.model_name, self.llm.config.block_size, self.engine
        max_model_len = self.llm.max_model_len

        async def prefill(request: web.Request) -> web.StreamResponse:
            return await serve_kv_source(
                request, engine.export, model=model, block_size=block_size, max_model_len=max_model_len
            )

        async def cached(request: web.Request) -> web.StreamResponse:
            return await serve_kv_source(
                request, engine.export_cached, model=model, block_size=block_size, max_model_len=max_model_len
            )

        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/kv/prefill", prefill)
        app.router.add_post("/v1/kv/cached", cached)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1)
        await runner.setup()
        await web.TCPSite(runner, self.config.kv_host, 0, ssl_context=self.config.ssl_context()).start()
        return runner, int(runner.addresses[0][1])


def counter_snapshot(counters: EngineCounters) -> dict[str, Any]:
    """What the core counts that the API process cannot: busy time and KV pulls (cumulative)."""
    return {
        "busy": {stage: clock.seconds for stage, clock in counters.busy.items()},
        "kv_pulls": dict(counters.kv_pulls),
        "kv_pulled_tokens": counters.kv_pulled_tokens,
        "kv_pull_served": counters.kv_pull_served,
        "kv_pull_served_tokens": counters.kv_pull_served_tokens,
    }
