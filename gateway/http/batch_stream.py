"""One client stream fed by the streams of a multi-prompt completion's prompts (``gateway.prompt_batch``).

Each prompt's relay (``gateway.http.relay.relay_stream``) writes to a part of the batch's stream as it would
to a client. The client's stream starts once every prompt's engine has started answering: until then a
prompt that fails gets the client a plain error answer, as a single prompt's does, and the stream's headers
name every prompt's engine. Then each part's events go out as they come, joined as vLLM joins a batch's:

- every chunk takes the batch's id (the first chunk's) and its choices the batch's index (prompt index x
  ``n`` + the choice's own);
- each prompt's ``[DONE]`` and usage chunk are held back: once every prompt has ended, one usage chunk with
  the sums (when the client asked for usage) and one ``[DONE]`` end the stream;
- an error event ends the client's stream at once (the SDK raises it and reads no further); the other
  prompts' relays then find their client gone, and stop their engines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web

from gateway.http.relay import StreamClient
from gateway.http.sse import data_of, split_events

PREDICTED_HEADER = "x-kvgate-predicted-cached-tokens"
_DONE_EVENT = b"data: [DONE]\n\n"


class BatchStream:
    """The client's stream of a batch of ``parts`` prompts, ``choices`` choices each."""

    def __init__(self, client: StreamClient, parts: int, choices: int, request_id: str) -> None:
        self._client = client
        self._choices = choices
        self._request_id = request_id
        self._headers: list[Mapping[str, str] | None] = [None] * parts
        self._started: asyncio.Future[web.StreamResponse] = asyncio.get_running_loop().create_future()
        self._streams: list[_PartStream] = []
        self._running = parts  # parts whose stream has not ended
        self._usages: list[dict[str, Any] | None] = [None] * parts
        self._usage_chunk: dict[str, Any] | None = None  # a part's usage chunk: the batch's is made of it
        self._id: Any = None  # the batch's chunk id: its first chunk's
        self._ended = False  # the client's stream has ended (or failed)

    def part(self, index: int) -> StreamClient:
        return _PartClient(self, index)

    def owns(self, answer: object) -> bool:
        """Whether ``answer`` is one of this batch's part streams (a prompt that was answered)."""
        return any(answer is s for s in self._streams)

    def response(self) -> web.StreamResponse:
        """The client's stream (once every part has started)."""
        return self._started.result()

    def _open(self, part: _PartStream) -> _PartStream:
        self._streams.append(part)
        return part

    async def start(self, index: int, headers: Mapping[str, str]) -> web.StreamResponse:
        """A part's engine has started answering: the client's stream, once every part's has."""
        self._headers[index] = headers
        if all(h is not None for h in self._headers) and not self._started.done():
            response = self._client.stream_response(
                merge_headers([h for h in self._headers if h is not None], self._request_id)
            )
            response.content_type = "text/event-stream"
            response.headers["Cache-Control"] = "no-cache"
            try:
                await response.prepare(None)  # type: ignore[arg-type]  # (the lean stream ignores it)
            except BaseException as exc:
                failed = ConnectionResetError(f"the client's stream could not start: {exc}")
                self._started.set_exception(failed)
                self._started.exception()  # (retrieved: the parts waiting for it raise it)
                raise
            self._started.set_result(response)
        return await asyncio.shield(self._started)

    @property
    def ended(self) -> bool:
        """The client's stream has ended: every part's has, or one part's error event ended it."""
        return self._ended

    async def write(self, index: int, data: bytes) -> None:
        response = self._started.result()
        if self._ended:
            raise ConnectionResetError("the batch's stream has ended")
        out: list[bytes] = []
        failed = False
        for event in split_events(data):
            payload = data_of(event)
            if payload is None or payload.strip() == b"[DONE]":
                if payload is None:
                    out.append(event)  # (a comment: a keep-alive)
                continue
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                out.append(event)
                continue
            if not isinstance(chunk, dict):
                out.append(event)
                continue
            if isinstance(chunk.get("error"), dict) and not chunk.get("choices"):
                out.append(event)
                failed = True
                break
            out.append(self._rewrite(index, chunk))
        if failed:
            self._ended = True  # (before the write's await: no other part writes after it)
        if out:
            await response.write(b"".join(out))
        if failed:
            await response.write_eof()

    def _rewrite(self, index: int, chunk: dict[str, Any]) -> bytes:
        """A part's chunk as the batch's: its id and choice indexes; b"" for a usage chunk (held back)."""
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if not choices and isinstance(usage, dict):
            self._usages[index] = usage
            self._usage_chunk = chunk
            return b""
        if self._id is None:
            self._id = chunk.get("id")
        chunk["id"] = self._id
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and isinstance(choice.get("index", 0), int):
                    choice["index"] = index * self._choices + choice.get("index", 0)
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    async def end(self, index: int) -> None:
        """A part's stream has ended; the last one ends the client's."""
        self._running -= 1
        if self._running or self._ended:
            return
        self._ended = True
        response = self._started.result()
        usages = [u for u in self._usages if u is not None]
        tail = b""
        if usages and self._usage_chunk is not None:
            chunk = {**self._usage_chunk, "usage": sum_usage(usages)}
            if self._id is not None:
                chunk["id"] = self._id
            tail = b"data: " + orjson.dumps(chunk) + b"\n\n"
        await response.write(tail + _DONE_EVENT)
        await response.write_eof()


class _PartClient:
    """What a prompt's relay takes for its client."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: BatchStream, index: int) -> None:
        self._batch = batch
        self._index = index

    def stream_response(self, headers: Mapping[str, str]) -> web.StreamResponse:
        return self._batch._open(_PartStream(self._batch, self._index, headers))


class _PartStream(web.StreamResponse):
    """A prompt's stream, as its relay writes it (``prepare``, ``write``, ``write_eof``)."""

    def __init__(self, batch: BatchStream, index: int, headers: Mapping[str, str]) -> None:
        super().__init__(status=200, headers=headers)
        self._batch = batch
        self._index = index
        self._gateway_headers = dict(headers)
        self._ended = False

    async def prepare(self, request: Any) -> None:
        await self._batch.start(self._index, self._gateway_headers)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if data:
            await self._batch.write(self._index, bytes(data))

    async def write_eof(self, data: bytes = b"") -> None:
        if self._ended:
            return
        if data:
            await self.write(data)
        self._ended = True
        await self._batch.end(self._index)


def merge_headers(parts: Sequence[Mapping[str, str]], request_id: str) -> dict[str, str]:
    """The batch's answer headers, of its prompts': a value every prompt shares as it is; the predicted cached
    tokens summed; any other (the engine, region, route of each prompt) listed in prompt order, joined
    with ", " as HTTP joins a field's values."""
    merged: dict[str, str] = {}
    for name in dict.fromkeys(name for headers in parts for name in headers):
        values = [headers[name] for headers in parts if name in headers]
        if name == PREDICTED_HEADER:
            merged[name] = str(sum(int(v) for v in values if v.isdigit()))
        elif len(values) == len(parts) and len(set(values)) == 1:
            merged[name] = values[0]
        else:
            merged[name] = ", ".join(values)
    merged["x-request-id"] = request_id
    return merged


def sum_usage(usages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The usage of a batch: its prompts' counts (and cost) summed, field by field, nested ones too."""
    total: dict[str, Any] = {}
    for usage in usages:
        for name, value in usage.items():
            have = total.get(name)
            if isinstance(value, bool) or value is None:
                total.setdefault(name, value)
            elif isinstance(value, int | float) and isinstance(have, int | float | None):
                total[name] = value if have is None else have + value
                if name == "cost":  # dollars of whole picodollars (cache.ledger): no float dust in the sum
                    total[name] = round(total[name], 12)
            elif isinstance(value, Mapping) and isinstance(have, Mapping | None):
                total[name] = sum_usage([have, value]) if have is not None else dict(value)
            else:
                total.setdefault(name, value)
    return total
