"""A completion naming several prompts (parsed by ``engine.completion_batch``) served as vLLM serves it: a
request per prompt, all submitted to the engine together so that its scheduler runs them side by side, and
their answers joined into one.

The join is vLLM's (and the gateway's, ``gateway.prompt_batch``): choice ``index`` = prompt index x ``n`` +
the choice's own index; usage summed over the prompts (prompt, completion and total tokens, and the cached
tokens each prompt found); a stream carries the prompts' chunks interleaved as they come, then one usage
chunk (when ``stream_options.include_usage`` asks for it) and one ``[DONE]``.

The answer starts once every prompt has its first output: until then any prompt's failure (the engine
refusing it, the engine failing) is the request's HTTP error, and the other prompts are aborted. An engine on
a thread here checks every prompt before any is submitted. A client that leaves aborts every prompt still
running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine.async_engine import EngineDead
from engine.engine_types import RequestRejected, StepOutput
from engine.kv_serve import end_stream_failed, engine_failed
from engine.openai_api import GenerationRequest
from engine.openai_choices import Choices, StreamAnswer, WholeAnswer
from engine.openai_errors import OpenAIError, json_response
from engine.openai_format import choices_body, sse_response, usage

if TYPE_CHECKING:
    from engine.server import EngineServer

# (prompt index, (choice index, output) | the prompt's failure | None once the prompt is done)
_Item = tuple[int, tuple[int, StepOutput] | BaseException | None]


async def serve_batch(
    server: EngineServer, request: web.Request, reqs: Sequence[GenerationRequest], headers: dict[str, str]
) -> web.StreamResponse:
    """Serve the prompts ``reqs`` of one completion as one answer."""
    try:
        parts, firsts = await _start(server, reqs)
    except OpenAIError as exc:
        return exc.to_response(headers)
    # (A batch carries no K/V transfer: completion_batch refuses kv_transfer_params for one.)
    headers.update(server.transfer_headers(reqs[0], firsts[0]))
    outputs = BatchOutputs(parts)
    async with contextlib.aclosing(outputs):  # closing early (client gone) aborts every prompt
        if reqs[0].stream:
            return await _stream(server, request, reqs, firsts, outputs, headers)
        return await _whole(server, reqs, firsts, outputs, headers)


async def _start(
    server: EngineServer, reqs: Sequence[GenerationRequest]
) -> tuple[list[Choices], list[StepOutput]]:
    """Submit every prompt's choice 0 at once and wait for each one's first output; the first failure (the
    lowest prompt's, when several fail) aborts the others and is raised as an :class:`OpenAIError`."""
    if server.llm is not None:  # what the engine would refuse, refused before anything is submitted
        for i, req in enumerate(reqs):
            try:
                server.llm.check_request(req.prompt_token_ids.tolist(), req.params)
            except RequestRejected as exc:
                raise OpenAIError(
                    f"prompt {i}: {exc}", param="prompt", code="context_length_exceeded"
                ) from None
    parts = [server.choices(req) for req in reqs]
    # Tasks started in one pass of the event loop: each submits its prompt before the next one runs.
    tasks = [asyncio.ensure_future(server.first_output(part)) for part in parts]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled: the client left while the prompts were starting
        await _abort(tasks, parts)
        raise
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
    if failed is None:
        return parts, [task.result() for task in tasks]
    await _abort(tasks, parts)
    error = failed.exception()
    assert error is not None
    if isinstance(error, OpenAIError) and error.status == 400:
        prompt = tasks.index(failed)
        error = OpenAIError(
            f"prompt {prompt}: {error.message}", param=error.param or "prompt", code=error.code
        )
    raise error


async def _abort(tasks: Sequence[asyncio.Future[StepOutput]], parts: Sequence[Choices]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # (their errors retrieved)
    for part in parts:
        await part.aclose()


class BatchOutputs:
    """The outputs of a batch's prompts after their first ones, as ``(prompt index, choice index, output)``
    in the order they come; a prompt's failure is raised. ``aclose`` aborts every prompt still running."""

    def __init__(self, parts: Sequence[Choices]) -> None:
        self._parts = list(parts)
        self._tasks: list[asyncio.Task[None]] = []

    async def __aiter__(self) -> AsyncIterator[tuple[int, int, StepOutput]]:
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks = [asyncio.create_task(_pump(i, part, queue)) for i, part in enumerate(self._parts)]
        running = len(self._tasks)
        while running:
            prompt, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield prompt, item[0], item[1]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for part in self._parts:
            await part.aclose()


async def _pump(prompt: int, part: Choices, queue: asyncio.Queue[_Item]) -> None:
    try:
        async for index, out in part:
            queue.put_nowait((prompt, (index, out)))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        queue.put_nowait((prompt, exc))
    queue.put_nowait((prompt, None))


def summed_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The usage of a batch: its prompts' token counts summed, cached tokens too."""
    return usage(
        sum(u["prompt_tokens"] for u in usages),
        sum(u["completion_tokens"] for u in usages),
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages),
    )


async def _whole(
    server: EngineServer,
    reqs: Sequence[GenerationRequest],
    firsts: Sequence[StepOutput],
    rest: BatchOutputs,
    headers: dict[str, str],
) -> web.Response:
    answers = [WholeAnswer(req, server.tokenizer, i * req.n) for i, req in enumerate(reqs)]
    for answer, first in zip(answers, firsts, strict=True):
        answer.add(0, first)
    try:
        async for prompt, index, out in rest:
            answers[prompt].add(index, out)
    except EngineDead as exc:
        return engine_failed(exc).to_response(headers)
    choices = [choice for answer in answers for choice in answer.choices()]
    body = choices_body(reqs[0], choices, summed_usage([answer.usage() for answer in answers]))
    return json_response(body, headers=headers)


async def _stream(
    server: EngineServer,
    request: web.Request,
    reqs: Sequence[GenerationRequest],
    firsts: Sequence[StepOutput],
    rest: BatchOutputs,
    headers: dict[str, str],
) -> web.StreamResponse:
    response = sse_response(headers)
    # (A completion's stream has nothing before its first token: no start() to write.)
    answers = [StreamAnswer(req, server.tokenizer, i * req.n) for i, req in enumerate(reqs)]
    await response.prepare(request)
    try:
        await response.write(b"".join(a.chunk(0, first) for a, first in zip(answers, firsts, strict=True)))
        async for prompt, index, out in rest:
            if chunk := answers[prompt].chunk(index, out):
                await response.write(chunk)
        await response.write(answers[0].end(summed_usage([answer.usage() for answer in answers])))
        await response.write_eof()
    except EngineDead as exc:
        await end_stream_failed(response, exc)
    except ConnectionResetError:
        pass  # the client left; closing the outputs aborts every prompt
    return response
