"""Writing a KV transfer's frames to an HTTP response without copying their payloads.

aiohttp's chunked writes join each chunk's length line, data and CRLF into one bytes (before Python 3.12.9
it never uses vectored writes), and the asyncio transport copies what the socket does not take at once into
its own buffer. Here each frame goes to the transport as it is: its small head (chunk length, frame length,
msgpack header) as one write, then its payload in pieces, each written once the transport's buffer is empty,
so the kernel copies straight from the staging buffer; a payload of many buffers (a frame sent from the
cache's own memory, run by run) goes in vectored writes where the transport has them (uvloop's, Python
3.12.9's on), one system call for many buffers. While the stream lasts, the transport's buffer
limit is 0: a drained transport then holds none of the frame, the moment its staging buffer may be reused
(uvloop's and Python 3.12's transports keep a reference to what they are given, not a copy).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from engine.kv_transfer import StagedFrame

PIECE_BYTES = 1 << 20  # a payload goes to the socket this much at a time
MAX_BUFFERS = 512  # per vectored write


def vectored_writes(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``writelines`` on the loop's transports sends the buffers as they are (uvloop: one ``writev``;
    Python from 3.12.9, 3.13.2: ``sendmsg``) rather than joining them first, as Python 3.11's does (and
    3.12 to 3.12.8, whose vectored writes aiohttp avoids for a bug)."""
    if type(loop).__module__.startswith("uvloop"):
        return True
    return sys.version_info >= (3, 13, 2) or (3, 12, 9) <= sys.version_info < (3, 13)


async def write_frames(
    request: web.Request, response: web.StreamResponse, first: StagedFrame, rest: AsyncIterator[StagedFrame]
) -> None:
    """Prepare ``response`` (chunked) and write ``first``, then every frame of ``rest``, releasing each one
    once written. Raises ConnectionResetError when the client leaves; the caller ends the response."""
    try:
        writer = await response.prepare(request)  # sends the status line and headers
        transport = request.transport
        if writer is None or transport is None or transport.is_closing():
            raise ConnectionResetError("the receiving engine left")
    except BaseException:
        first.release(reuse=False)
        raise
    low, high = transport.get_write_buffer_limits()
    transport.set_write_buffer_limits(high=0)
    try:
        await _write(transport, writer, first)
        async for frame in rest:
            await _write(transport, writer, frame)
    finally:
        if not transport.is_closing():
            transport.set_write_buffer_limits(high=high, low=low)


async def _write(transport: asyncio.Transport, writer: AbstractStreamWriter, frame: StagedFrame) -> None:
    try:
        if frame.ready is not None and not frame.ready.query():  # type: ignore[no-untyped-call]
            await asyncio.to_thread(frame.ready.synchronize)  # the copy from the GPU; the loop goes on
        _check(transport)
        transport.write(b"%x\r\n" % frame.nbytes + frame.head)  # one HTTP chunk per frame
        if len(frame.payload) > 1 and vectored_writes(asyncio.get_running_loop()):
            for batch in _batches(frame.payload):
                await writer.drain()
                _check(transport)
                transport.writelines(batch)
        else:
            for payload in frame.payload:
                for offset in range(0, payload.nbytes, PIECE_BYTES):
                    await writer.drain()  # returns once the transport's buffer is empty (its limit is 0)
                    _check(transport)
                    transport.write(payload[offset : offset + PIECE_BYTES])
        transport.write(b"\r\n")
        await writer.drain()
        _check(transport)
    except BaseException:
        frame.release(reuse=False)  # a broken transport may still hold a piece of it
        raise
    frame.release()


def _batches(payload: tuple[memoryview, ...]) -> list[list[memoryview]]:
    """``payload`` in vectored writes of about ``PIECE_BYTES`` and at most ``MAX_BUFFERS`` buffers each."""
    batches: list[list[memoryview]] = [[]]
    size = 0
    for buf in payload:
        if batches[-1] and (size + buf.nbytes > PIECE_BYTES or len(batches[-1]) >= MAX_BUFFERS):
            batches.append([])
            size = 0
        batches[-1].append(buf)
        size += buf.nbytes
    return batches


def _check(transport: asyncio.Transport) -> None:
    # A transport whose connection is gone drops writes silently; the transfer must stop instead.
    if transport.is_closing():
        raise ConnectionResetError("the receiving engine left")
