"""The KV transfer client keeps connections alive: transfers to one peer share a TCP connection, one the peer
closed while idle is replaced, and one whose answer was not read to its end is never reused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from engine.kv_client import ConnectionPool, HttpBodyReader
from tests.serving import serve


@pytest.fixture
async def peer() -> AsyncIterator[tuple[str, list[object]]]:
    """A server streaming a chunked answer (as a KV source does); it records each request's client port."""
    ports: list[object] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        ports.append(request.transport.get_extra_info("peername")[1] if request.transport else None)
        await request.read()
        response = web.StreamResponse()
        await response.prepare(request)
        for piece in (b"abc", b"defgh"):
            await response.write(piece)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/kv", handler)
    runner = web.AppRunner(app, keepalive_timeout=0.5)
    url = await serve(runner)
    yield url + "/kv", ports
    await runner.cleanup()


def transfer(url: str, pool: ConnectionPool, read: int = 8) -> bytes:
    reader = HttpBodyReader(url, b"{}", pool=pool)
    try:
        assert reader.open() == 200
        return reader.read_exact(read)
    finally:
        reader.close()


async def test_transfers_to_one_peer_share_one_connection(peer: tuple[str, list[object]]) -> None:
    url, ports = peer
    pool = ConnectionPool()
    try:
        assert await asyncio.to_thread(transfer, url, pool) == b"abcdefgh"
        assert await asyncio.to_thread(transfer, url, pool) == b"abcdefgh"
        assert pool.opened == 1 and len(ports) == 2 and ports[0] == ports[1]  # one TCP connection

        await asyncio.sleep(1.0)  # the server closes the idle connection: the next transfer opens another
        assert await asyncio.to_thread(transfer, url, pool) == b"abcdefgh"
        assert pool.opened == 2 and ports[2] != ports[1]

        assert await asyncio.to_thread(transfer, url, pool, 3) == b"abc"  # left unread: not reused
        assert await asyncio.to_thread(transfer, url, pool) == b"abcdefgh"
        assert pool.opened == 3
    finally:
        pool.clear()
