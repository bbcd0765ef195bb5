"""The simulated engine's per-request mode (no ``--profile``): ``max_running`` slots taken FIFO, and each
request sleeping on its own for what its prefill and decode cost. Requests do not batch: a slot's holder
costs the others nothing but the slot (``engine/sim/batching_loop.py`` is the mode where they do)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine.openai_api import FinishReason, GenerationRequest
from engine.openai_errors import json_response
from engine.openai_format import SseFormatter, response_body, sse_response, usage

if TYPE_CHECKING:
    from engine.sim.server import SimEngine


class _Waiter:
    __slots__ = ("future", "tokens")

    def __init__(self, future: asyncio.Future[None], tokens: int) -> None:
        self.future = future
        self.tokens = tokens


class SlotQueue:
    """``max_running`` slots, taken first come first served; a request waits while all are taken."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self.running = 0  # requests holding a slot
        self.waiting_tokens = 0  # prefill of queued requests: their tokens past the prefix cached when queued
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def admit(self, tokens: int) -> None:
        """Take a slot, queueing FIFO behind earlier requests while all are taken."""
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return
        waiter = _Waiter(asyncio.get_running_loop().create_future(), tokens)
        self._waiters.append(waiter)
        self.waiting_tokens += tokens
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release()  # granted a slot just as the client left: pass it on
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass  # already dequeued (and skipped) by release
                else:
                    self.waiting_tokens -= tokens
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            self.waiting_tokens -= waiter.tokens
            if not waiter.future.done():  # a cancelled waiter is skipped
                waiter.future.set_result(None)  # the slot passes on: running stays the same
                return
        self.running -= 1


async def generate_per_request(
    sim: SimEngine, request: web.Request, req: GenerationRequest, headers: dict[str, str]
) -> web.StreamResponse:
    """Serve one parsed request in the per-request mode of ``SimEngine``."""
    cfg = sim.config
    hashes = sim.prompt_hashes(req.prompt_token_ids, req.cache_salt, req.cache_shared_blocks)
    # Queued, it counts the prefill it will compute (as kvgate's engine and the batching mode count it): its
    # tokens past the prefix cached now. (A peer pull, or an eviction meanwhile, is known only once admitted.)
    cached_now = sim.usable_blocks(req, sim.cache.match(hashes)) * cfg.block_size
    await sim.slots.admit(req.prompt_tokens - cached_now)
    pinned: list[int] = []
    try:
        n_cached = await sim.cached_blocks(req, hashes)
        cached_tokens = n_cached * cfg.block_size
        if cfg.prefill_s_per_token or cfg.decode_s_per_token:
            # With every cost at zero nothing below awaits before store_answer() stores the prompt and the
            # answer at once, so no other request can evict these blocks meanwhile: pins would protect
            # nothing, and skipping them keeps the benchmark path lean.
            pinned = sim.cache.acquire(hashes[:n_cached])
            uncached = req.prompt_tokens - cached_tokens
            if uncached and cfg.prefill_s_per_token > 0:
                with sim.busy("prefill"):
                    await asyncio.sleep(uncached * cfg.prefill_s_per_token)
            if n_cached < len(hashes):
                sim.cache.store(hashes)
                pinned += sim.cache.acquire(hashes[n_cached:])

        text, finish = sim.answer(req)
        usage_obj = usage(req.prompt_tokens, len(text), cached_tokens)
        sim.counters.finished(req.prompt_tokens, cached_tokens, len(text))

        if req.stream:
            return await _stream(sim, request, req, hashes, text, finish, usage_obj, headers)
        if text and cfg.decode_s_per_token > 0:
            with sim.busy("decode"):
                await asyncio.sleep(len(text) * cfg.decode_s_per_token)
        # Stored before the answer leaves, so a client's next turn is sure to find it.
        sim.store_answer(req, hashes, text)
        return json_response(response_body(req, text, finish, usage_obj), headers=headers)
    finally:
        # Also on cancellation (client gone, with handler_cancellation) and errors: never leak a slot.
        if pinned:
            sim.cache.release(pinned)
        sim.slots.release()


async def _stream(
    sim: SimEngine,
    request: web.Request,
    req: GenerationRequest,
    hashes: list[int],
    text: str,
    finish: FinishReason,
    usage_obj: dict[str, Any],
    headers: dict[str, str],
) -> web.StreamResponse:
    resp = sse_response(headers)
    fmt = SseFormatter(req)
    decode_s = sim.config.decode_s_per_token
    try:
        if decode_s <= 0:
            # No decode cost: one write for the whole answer, still one SSE chunk per token.
            sim.store_answer(req, hashes, text)
            await resp.prepare(request)
            await resp.write(
                fmt.start() + b"".join([fmt.token(ch) for ch in text]) + fmt.finish(finish, usage_obj)
            )
        else:
            await resp.prepare(request)
            start = fmt.start()
            if start:
                await resp.write(start)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with sim.busy("decode"):
                for i, ch in enumerate(text):
                    # Sleep to a deadline rather than a fixed delay so timer overshoot does not add up.
                    delay = t0 + (i + 1) * decode_s - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await resp.write(fmt.token(ch))
            sim.store_answer(req, hashes, text)
            await resp.write(fmt.finish(finish, usage_obj))
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away mid-stream; the caller's finally frees its slot and pins
    return resp
