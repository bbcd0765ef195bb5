"""A completion naming several prompts (``prompt: ["a", "b"]``, OpenAI's and vLLM's batch form), served as a
request per prompt and answered as one.

Each prompt is prepared, routed, dispatched and billed as a request of its own: it goes to the engine that
holds its own prefix (prompts of one batch seldom share theirs), its record has its own cached tokens, and an
engine that fails is retried for that prompt only. vLLM, given the batch whole, runs the prompts on one
engine and reports one prompt's cached tokens for all of them (the first's in a stream, the last's in a
whole answer).

The answers are joined as vLLM joins them: choice ``index`` = prompt index x ``n`` + the choice's own index,
usage summed. A prompt that fails before its answer starts fails the batch: the others are cancelled (and
billed as aborted, for the prompt their engine took). Streams: ``gateway.http.batch_stream``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson

from gateway.http.batch_stream import BatchStream, merge_headers, sum_usage
from gateway.http.http_wire import Answer, WholeAnswer
from gateway.http.relay import StreamClient
from gateway.prepared import Prepared

# Serves one prepared request to a client: the gateway's ``_serve``.
Serve = Callable[[StreamClient, float, "Prepared"], Awaitable[Answer]]


class PromptBatch:
    """The prompts of one completion, each a ``Prepared`` request. The engines get the parts' request ids,
    the client's id with ``-<prompt index>`` (vLLM names its per-prompt requests so); the client gets the
    batch's."""

    __slots__ = ("parts", "request_id")

    def __init__(self, parts: Sequence[Prepared]) -> None:
        self.parts = list(parts)
        self.request_id = self.parts[0].request_id  # the client's x-request-id, or one made for the first
        for i, part in enumerate(self.parts):
            part.request_id = f"{self.request_id}-{i}"
            if i:
                # The session (x-session-affinity, prompt_cache_key) goes with the first prompt only: the
                # others go where their own prefixes are. Dispatched at once, every part of one session
                # moved its binding to its own prefix in turn, and each pulled the others off theirs.
                part.session_id = None

    @property
    def stream(self) -> bool:
        return self.parts[0].stream

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.parts)

    @property
    def output_budget(self) -> int:
        return sum(p.output_budget for p in self.parts)

    @property
    def choices(self) -> int:
        """``n``: the choices each prompt's answer holds (``best_of`` is generated, not answered)."""
        n = self.parts[0].body.get("n")
        return n if isinstance(n, int) and n > 1 else 1

    def admitted(self, key_id: str, ratelimit_headers: dict[str, str] | None) -> None:
        for part in self.parts:
            part.key_id = key_id
            part.ratelimit_headers = ratelimit_headers


async def serve_batch(serve: Serve, client: StreamClient, received: float, batch: PromptBatch) -> Answer:
    """Serve every prompt at once and join their answers; the first prompt that fails (an error raised, or an
    engine's error answer) is the batch's answer, and the rest are cancelled."""
    stream = BatchStream(client, len(batch.parts), batch.choices, batch.request_id) if batch.stream else None
    tasks: list[asyncio.Future[Answer]] = [
        asyncio.ensure_future(serve(stream.part(i) if stream is not None else client, received, part))
        for i, part in enumerate(batch.parts)
    ]
    try:
        pending: set[asyncio.Future[Answer]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            # (The lowest prompt's failure first, when several end at once.)
            for task in sorted(done, key=tasks.index):
                try:
                    answer = task.result()  # (raises what the prompt raised)
                except ConnectionResetError:
                    if stream is not None and stream.ended:
                        continue  # (a part's error event ended the client's stream; this part was cut)
                    raise
                served = stream.owns(answer) if stream is not None else _whole_200(answer)
                if not served:
                    answer.headers["x-request-id"] = batch.request_id
                    return answer
    finally:
        for task in tasks:
            task.cancel()
        # Each cancelled prompt accounts for itself (gateway.http.relay): awaited, so that its record is
        # made before the batch's answer goes out.
        await asyncio.gather(*tasks, return_exceptions=True)
    if stream is not None:
        return stream.response()
    return join_whole([task.result() for task in tasks], batch.choices, batch.request_id)


def _whole_200(answer: Answer) -> bool:
    return isinstance(answer, WholeAnswer) and answer.status == 200


def join_whole(answers: Sequence[Answer], choices: int, request_id: str) -> WholeAnswer:
    """One answer of the prompts' whole answers (each a 200 ``WholeAnswer``, its body a JSON object: checked
    by the relay): the first's fields, every prompt's choices re-indexed, usage summed."""
    bodies: list[dict[str, Any]] = []
    for answer in answers:
        assert isinstance(answer, WholeAnswer)
        bodies.append(orjson.loads(answer.content()))
    joined = dict(bodies[0])
    joined_choices: list[Any] = []
    for i, body in enumerate(bodies):
        for choice in body.get("choices") or []:
            if isinstance(choice, dict) and isinstance(choice.get("index", 0), int):
                choice["index"] = i * choices + choice.get("index", 0)
            joined_choices.append(choice)
    joined["choices"] = joined_choices
    usages = [b["usage"] for b in bodies if isinstance(b.get("usage"), dict)]
    if usages:
        joined["usage"] = sum_usage(usages)
    headers = merge_headers([a.headers for a in answers if isinstance(a, WholeAnswer)], request_id)
    return WholeAnswer(orjson.dumps(joined), headers)
