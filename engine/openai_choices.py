"""The ``n`` choices of one OpenAI request: one engine sequence each, their outputs merged into one answer.

Choice 0 starts alone (with the request's K/V transfer, if any); the others start once its first output
shows its prompt computed, so that they find the prompt in the prefix cache instead of computing (or
fetching) it again. Choice i of a seeded request draws with seed + i.

:class:`WholeAnswer` gathers the outputs into the non-streamed body, :class:`StreamAnswer` turns each into
its SSE bytes; both attach the ``logprobs`` objects when the request asked for them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from cache.tokens import Tokenizer
from engine.engine_types import StepOutput, TokenLogprob
from engine.openai_api import FinishReason, GenerationRequest
from engine.openai_format import ChoiceBody, LogprobsFormatter, SseFormatter, choices_body, usage
from engine.sequence import SamplingParams

# (choice index, its parameters, whether it carries the request's K/V transfer) -> its outputs
StartChoice = Callable[[int, SamplingParams, bool], AsyncGenerator[StepOutput, None]]


class Choices:
    """The outputs of a request's choices: ``first()`` is choice 0's first output (errors before it are the
    request's errors), iteration yields ``(index, output)`` for all the rest. ``aclose`` aborts whatever
    is still running."""

    def __init__(self, req: GenerationRequest, start: StartChoice) -> None:
        self._req = req
        self._start = start
        self._gens: list[AsyncGenerator[StepOutput, None]] = [start(0, req.choice_params(0), True)]
        self._tasks: list[asyncio.Task[None]] = []

    async def first(self) -> StepOutput:
        return await anext(self._gens[0])

    async def __aiter__(self) -> AsyncIterator[tuple[int, StepOutput]]:
        req = self._req
        if req.n == 1:  # no tasks, no queue: the common case costs what it did before choices
            async for out in self._gens[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, StepOutput | BaseException | None]] = asyncio.Queue()
        self._gens += [self._start(i, req.choice_params(i), False) for i in range(1, req.n)]
        self._tasks = [asyncio.create_task(_pump(i, gen, queue)) for i, gen in enumerate(self._gens)]
        running = len(self._tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def aclose(self) -> None:
        """Abort every choice still running (a generator closed early aborts its sequence)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for gen in self._gens:
            with contextlib.suppress(RuntimeError):  # one a cancelled task was running
                await gen.aclose()


async def _pump(
    index: int,
    gen: AsyncGenerator[StepOutput, None],
    queue: asyncio.Queue[tuple[int, StepOutput | BaseException | None]],
) -> None:
    try:
        async for out in gen:
            queue.put_nowait((index, out))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        queue.put_nowait((index, exc))
    queue.put_nowait((index, None))


def finish_reason(out: StepOutput) -> FinishReason:
    return "length" if out.finish_reason == "length" else "stop"


class _Usage:
    """Usage over the choices: the prompt (and its cached part) once, as choice 0 saw it, the completion
    tokens of every choice."""

    def __init__(self, n: int) -> None:
        self._last: list[StepOutput | None] = [None] * n

    def add(self, index: int, out: StepOutput) -> None:
        self._last[index] = out

    def usage(self) -> dict[str, Any]:
        first = self._last[0]
        assert first is not None
        completion = sum(out.completion_tokens for out in self._last if out is not None)
        return usage(first.prompt_tokens, completion, first.cached_tokens)


class WholeAnswer:
    """The non-streamed answer: feed it every output, then take its ``body``. ``first_index`` is the index
    its choice 0 is answered with (a prompt's place in a batch: ``engine.batch_serve``)."""

    def __init__(self, req: GenerationRequest, tokenizer: Tokenizer, first_index: int = 0) -> None:
        self._req = req
        self._tok = tokenizer
        self._first_index = first_index
        self._text: list[list[str]] = [[] for _ in range(req.n)]
        self._logprobs: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
        self._reason: list[FinishReason] = ["stop"] * req.n
        self._usage = _Usage(req.n)

    def add(self, index: int, out: StepOutput) -> None:
        self._text[index].append(out.text)
        self._logprobs[index].extend(out.logprobs)
        self._reason[index] = finish_reason(out)
        self._usage.add(index, out)

    def body(self) -> bytes:
        return choices_body(self._req, self.choices(), self.usage())

    def usage(self) -> dict[str, Any]:
        return self._usage.usage()

    def choices(self) -> list[ChoiceBody]:
        req = self._req
        return [
            ChoiceBody(
                self._first_index + i,
                "".join(self._text[i]),
                self._reason[i],
                None
                if req.logprobs is None
                else LogprobsFormatter(req.kind, self._tok).render(self._logprobs[i]),
            )
            for i in range(req.n)
        ]


class StreamAnswer:
    """The SSE bytes of a streamed answer: ``start()``, then ``chunk`` of every output, then ``end()``.
    Logprobs of tokens whose text is still held back (a possible stop string, half a character) wait for
    the chunk that brings it, or go out with the choice's finish chunk. ``first_index`` is the index its
    choice 0 is streamed with (a prompt's place in a batch: ``engine.batch_serve``)."""

    def __init__(self, req: GenerationRequest, tokenizer: Tokenizer, first_index: int = 0) -> None:
        self._req = req
        self._first_index = first_index
        self._fmt = SseFormatter(req)
        self._lp = (
            [LogprobsFormatter(req.kind, tokenizer) for _ in range(req.n)] if req.logprobs is not None else []
        )
        self._pending: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
        self._usage = _Usage(req.n)

    def start(self) -> bytes:
        return self._fmt.start()

    def chunk(self, index: int, out: StepOutput) -> bytes:
        self._usage.add(index, out)
        self._pending[index].extend(out.logprobs)
        parts = []
        answered = self._first_index + index
        if out.text:
            parts.append(self._fmt.token(out.text, answered, self._take(index)))
        if out.finished:
            leftover = self._take(index) if self._pending[index] else None
            parts.append(self._fmt.finish_choice(finish_reason(out), answered, leftover))
        return b"".join(parts)

    def _take(self, index: int) -> dict[str, Any] | None:
        if not self._lp:
            return None
        entries, self._pending[index] = self._pending[index], []
        return self._lp[index].render(entries)

    def usage(self) -> dict[str, Any]:
        return self._usage.usage()

    def end(self, usage_obj: dict[str, Any] | None = None) -> bytes:
        """The usage chunk (if asked for: this answer's, or ``usage_obj``) and ``[DONE]``."""
        return self._fmt.end(self.usage() if usage_obj is None else usage_obj)
