"""The simulated engine's opt-in batching mode: one step loop drives a ``perfmodel`` batching engine in real
time (``--profile NAME``; issue 24: without it the simulator's requests never queue behind each other's work).

Every request is submitted to one :class:`perfmodel.batching.BatchingEngine` with its prompt tokens (the
simulator's own tokenization), the tokens its prefix cache (or a KV pull) supplies and its output tokens
(``max_tokens``, or fewer where a stop string cuts the answer). :class:`BatchingLoop` executes the model's
steps one by one on the event loop's clock, each at the instant it ends (so the engine's state is the state
of the work not yet done: a step's chunk stays queued, a request stays running until its last step ends),
and wakes each request's handler when its first token is due and on each of its decode steps; a streamed
answer gets one token per step, as from a real engine. The simulator's ``/health`` load (running, waiting,
waiting_tokens = prefill tokens still to compute) is the batching engine's.

Model time is the event loop's clock (``loop.time()``): a request arrives when submitted and a step that
ends at ``t`` is executed when the loop reaches ``t``. The plan of a step does not change while the loop
sleeps towards its end: a step admits only what arrived by its start.

A request whose client goes away stays in the batching engine until it finishes (the model has no abort);
its handler just stops listening.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from cache.cancelling import cancel_and_wait
from engine.metrics import EngineCounters
from engine.openai_api import GenerationRequest
from engine.openai_errors import OpenAIError, json_response
from engine.openai_format import SseFormatter, response_body, sse_response, usage
from perfmodel.batching import BatchingEngine, StepRecord
from perfmodel.profiles import EngineProfile

if TYPE_CHECKING:
    from engine.sim.server import SimEngine

STEP_HISTORY = 4096  # executed steps kept for inspection (tests, debugging)


@dataclass(frozen=True, slots=True)
class ExecutedStep:
    """One step of the loop: the model's record and the loop time at which it was executed (its end)."""

    record: StepRecord
    executed_at_s: float


class Ticket:
    """One request inside the batching engine, as its handler sees it."""

    __slots__ = ("_changed", "_loop", "finished", "key", "output_tokens", "tokens")

    def __init__(self, loop: BatchingLoop, key: str, output_tokens: int) -> None:
        self._loop = loop
        self.key = key
        self.output_tokens = output_tokens
        self.tokens = 0  # output tokens produced so far (the first one by the prefill)
        self.finished = False
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()

    async def wait_tokens(self, n: int) -> int:
        """Wait until at least ``n`` output tokens are out (or the request finished); returns how many are."""
        while self.tokens < n and not self.finished:
            if self._loop.error is not None:
                raise RuntimeError("the simulator's step loop failed") from self._loop.error
            self._changed.clear()
            await self._changed.wait()
        return self.tokens

    async def wait_finished(self) -> None:
        await self.wait_tokens(self.output_tokens)


class BatchingLoop:
    """The step loop of one simulated engine (started with the first request, stopped by :meth:`close`)."""

    def __init__(self, profile: EngineProfile, counters: EngineCounters | None = None) -> None:
        self.profile = profile
        self.engine = BatchingEngine(profile)
        self.counters = counters
        self.steps: deque[ExecutedStep] = deque(maxlen=STEP_HISTORY)
        self.steps_total = 0
        self.error: BaseException | None = None
        self._tickets: dict[str, Ticket] = {}
        self._admitted: list[Ticket] = []  # running requests in admission order (the model's decode order)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._next_key = 0

    # ---- load, for /health and /metrics --------------------------------------------------------------

    @property
    def running(self) -> int:
        return self.engine.running

    @property
    def waiting(self) -> int:
        return self.engine.waiting

    @property
    def kv_used_tokens(self) -> int:
        """KV tokens the running requests hold (reserved at admission for prompt and output)."""
        return self.engine.kv_used_tokens

    @property
    def waiting_tokens(self) -> int:
        """Prefill tokens still to compute, over waiting and running requests (what routers queue behind)."""
        return self.engine.queued_prefill_tokens

    # ---- requests --------------------------------------------------------------------------------------

    def submit(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> Ticket:
        """Queue a request now (FIFO); ``ValueError`` if it could never fit the engine's KV cache."""
        if self.error is not None:
            raise RuntimeError("the simulator's step loop failed") from self.error
        loop = asyncio.get_running_loop()
        key = f"r{self._next_key}"
        self._next_key += 1
        self.engine.submit(key, loop.time(), prompt_tokens, cached_tokens, output_tokens)
        ticket = Ticket(self, key, output_tokens)
        self._tickets[key] = ticket
        if self._task is None:
            self._task = loop.create_task(self._run(), name="kvgate-sim-step-loop")
            self._task.add_done_callback(self._stopped)
        self._wake.set()
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """The request's client left before it finished: the model stops spending steps on it."""
        if ticket.finished:
            return
        self.engine.abort(ticket.key)
        self._tickets.pop(ticket.key, None)
        ticket.finished = True
        if ticket in self._admitted:
            self._admitted.remove(ticket)
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    # ---- the loop --------------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            end = self.engine.next_event_time()
            if end is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Always yield, even to a step already due, so that handlers run between steps.
            await asyncio.sleep(max(0.0, end - loop.time()))
            record = self.engine.step()
            if record is None:  # every request of the planned step was aborted meanwhile
                continue
            self._dispatch(record, loop.time())

    def _dispatch(self, record: StepRecord, now: float) -> None:
        self.steps.append(ExecutedStep(record, now))
        self.steps_total += 1
        if self.counters is not None and record.duration_s > 0:
            work = record.prefill_tokens + record.decode_seqs
            prefill_share = record.prefill_tokens / work if work else 1.0
            self.counters.busy["prefill"].add(record.duration_s * prefill_share)
            self.counters.busy["decode"].add(record.duration_s * (1.0 - prefill_share))
        tickets = self._tickets
        self._admitted.extend(tickets[key] for key in record.admitted)
        # The model gives the step's decode tokens to the first decode_seqs sequences past their prefill, in
        # admission order; those that got their first token in this very step are not among them.
        decodes = record.decode_seqs
        for ticket in self._admitted:
            if decodes == 0:
                break
            if ticket.tokens >= 1:
                ticket.tokens += 1
                decodes -= 1
                ticket._notify()
        for key in record.first_tokens:
            ticket = tickets[key]
            ticket.tokens = 1
            ticket._notify()
        if record.finished:
            for key in record.finished:
                ticket = tickets.pop(key)
                ticket.tokens = ticket.output_tokens
                ticket.finished = True
                ticket._notify()
                self.engine.forget(key)
            self._admitted = [t for t in self._admitted if not t.finished]

    def _stopped(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        self.error = task.exception()
        for ticket in self._tickets.values():
            ticket._notify()  # their handlers raise instead of waiting forever


# ------------------------------------------------------------------------------- the request handler


async def generate_batched(
    sim: SimEngine, request: web.Request, req: GenerationRequest, headers: dict[str, str]
) -> web.StreamResponse:
    """Serve one parsed request through ``sim.batching`` (the batching mode of ``SimEngine._generate``)."""
    batching = sim.batching
    assert batching is not None
    pinned: list[int] = []
    added: list[int] = []
    computing: list[int] = []  # the blocks this prompt's prefill computes, until it has run
    ticket: Ticket | None = None
    try:
        ids = req.prompt_token_ids
        hashes = sim.prompt_hashes(ids, req.cache_salt, req.cache_shared_blocks)
        n_cached = await sim.cached_blocks(req, hashes)
        cached_tokens = n_cached * sim.config.block_size
        pinned = sim.cache.acquire(hashes[:n_cached])
        text, finish = sim.answer(req)
        try:
            # An answer cut to nothing by a stop string still cost the prefill its first token.
            ticket = batching.submit(req.prompt_tokens, cached_tokens, max(1, len(text)))
        except ValueError as exc:
            return OpenAIError(f"the request does not fit this engine: {exc}").to_response(headers)
        # Cached once queued, as vLLM registers a prompt's blocks when it schedules their prefill and SGLang
        # inserts each chunk: admission is FIFO, so a prompt queued after this one is scheduled after these
        # blocks are computed and reuses them (a follow-up sent during a long prefill computed it all again
        # when the prefix was matched at arrival against blocks stored after the prefill).
        added = hashes[n_cached:]
        if added:
            sim.cache.store(hashes)
            computing = sim.cache.acquire(added)
            pinned += computing
            sim.cache.computing(computing)
        await ticket.wait_tokens(1)
        sim.cache.computed(computing)
        computing = []
        usage_obj = usage(req.prompt_tokens, len(text), cached_tokens)
        sim.counters.finished(req.prompt_tokens, cached_tokens, len(text))
        if not req.stream:
            await ticket.wait_finished()
            sim.store_answer(req, hashes, text)
            return json_response(response_body(req, text, finish, usage_obj), headers=headers)

        resp = sse_response(headers)
        fmt = SseFormatter(req)
        try:
            await resp.prepare(request)
            start = fmt.start()
            if start:
                await resp.write(start)
            sent = 0
            while sent < len(text):
                ready = min(await ticket.wait_tokens(sent + 1), len(text))
                await resp.write(b"".join([fmt.token(ch) for ch in text[sent:ready]]))
                sent = ready
            await ticket.wait_finished()
            sim.store_answer(req, hashes, text)
            await resp.write(fmt.finish(finish, usage_obj))
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away mid-stream (the model stops computing it: see finally)
        return resp
    finally:
        prefill_never_ran = False
        if ticket is not None and not ticket.finished:
            batching.abort(ticket)  # a client that left (or an error): no more steps for it
            prefill_never_ran = ticket.tokens == 0
        if computing:
            sim.cache.computed(computing)
        if pinned:
            sim.cache.release(pinned)
        if prefill_never_ran:
            sim.cache.discard(added)  # never computed: they must not serve another prompt
