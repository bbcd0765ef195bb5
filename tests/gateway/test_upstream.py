"""The lean upstream client against a real aiohttp server: keep-alive, streaming, timeouts, aborts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from gateway.http.upstream import UpstreamPool
from gateway.http.upstream_errors import UpstreamClosed, UpstreamConnectError, UpstreamTimeout


class Server:
    def __init__(self) -> None:
        self.peers: list[object] = []
        self.cancelled = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/echo", self.echo)
        self.app.router.add_get("/stream", self.stream)
        self.app.router.add_get("/slow", self.slow)
        self.app.router.add_get("/big", self.big)
        self.app.router.add_get("/close", self.close)

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        body = await request.read()
        return web.Response(body=body, headers={"x-seen": request.headers.get("x-test", "")})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(5):
            await response.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    async def slow(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return response

    async def big(self, request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (8 << 20))

    async def close(self, request: web.Request) -> web.Response:
        return web.Response(body=b"bye", headers={"Connection": "close"})


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, int]]:
    srv = Server()
    runner = web.AppRunner(srv.app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield srv, port
    await runner.cleanup()


async def test_requests_reuse_one_keep_alive_connection(server: tuple[Server, int]) -> None:
    srv, port = server
    pool = UpstreamPool("127.0.0.1", port)
    for i in range(5):
        response = await pool.request("POST", "/echo", f"hello {i}".encode(), [("x-test", str(i))])
        assert response.status == 200 and response.header(b"X-Seen") == str(i).encode()
        assert await response.read() == f"hello {i}".encode()
    assert len(set(srv.peers)) == 1 and pool.open_connections == 1
    pool.close()


async def test_concurrent_requests_open_more_connections(server: tuple[Server, int]) -> None:
    _, port = server
    pool = UpstreamPool("127.0.0.1", port)

    async def one(i: int) -> bytes:
        return await (await pool.request("POST", "/echo", str(i).encode())).read()

    assert await asyncio.gather(*(one(i) for i in range(20))) == [str(i).encode() for i in range(20)]
    assert 1 < pool.open_connections <= 20
    pool.close()


async def test_chunked_stream_arrives_in_order(server: tuple[Server, int]) -> None:
    _, port = server
    pool = UpstreamPool("127.0.0.1", port)
    response = await pool.request("GET", "/stream")
    parts = [batch async for batch in response.iter_batches(idle_timeout=5)]
    assert b"".join(parts) == b"".join(f"data: {i}\n\n".encode() for i in range(5))
    assert len(parts) >= 2  # delivered as it came, not at the end
    pool.close()


async def test_idle_timeout_aborts_and_the_server_sees_the_disconnect(server: tuple[Server, int]) -> None:
    srv, port = server
    pool = UpstreamPool("127.0.0.1", port)
    response = await pool.request("GET", "/slow")
    with pytest.raises(UpstreamTimeout):
        await response.read(idle_timeout=0.2)
    await asyncio.wait_for(srv.cancelled.wait(), 5)
    assert pool.open_connections == 0
    pool.close()


async def test_abort_closes_the_connection(server: tuple[Server, int]) -> None:
    srv, port = server
    pool = UpstreamPool("127.0.0.1", port)
    response = await pool.request("GET", "/slow")
    response.abort()
    await asyncio.wait_for(srv.cancelled.wait(), 5)
    pool.close()


async def test_connection_refused_is_a_connect_error() -> None:
    pool = UpstreamPool("127.0.0.1", 1)
    with pytest.raises(UpstreamConnectError) as info:
        await pool.request("GET", "/")
    assert info.value.before_response


async def test_server_closing_after_response_is_not_reused(server: tuple[Server, int]) -> None:
    _, port = server
    pool = UpstreamPool("127.0.0.1", port)
    assert await (await pool.request("GET", "/close")).read() == b"bye"
    assert await (await pool.request("POST", "/echo", b"again")).read() == b"again"
    pool.close()


async def test_a_pooled_connection_the_engine_closed_is_not_reused() -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)  # then drop the idle keep-alive connection, as servers do
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1])
    assert await (await pool.request("GET", "/")).read() == b"ok"
    await asyncio.sleep(0.2)
    assert pool.open_connections == 0  # noticed the close while idle
    assert await (await pool.request("GET", "/")).read() == b"ok"
    assert connections == 2
    pool.close()
    server.close()


async def test_a_slow_consumer_pauses_reading(server: tuple[Server, int]) -> None:
    _, port = server
    pool = UpstreamPool("127.0.0.1", port)
    response = await pool.request("GET", "/big")
    await asyncio.sleep(0.3)  # nobody reads: the client must stop pulling from the socket
    assert response._buffered < 4 << 20
    assert len(await response.read(idle_timeout=5)) == 8 << 20
    pool.close()


async def test_a_response_cut_short_is_an_error() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = UpstreamPool("127.0.0.1", port)
    response = await pool.request("GET", "/")
    with pytest.raises(UpstreamClosed) as info:
        await response.read(idle_timeout=5)
    assert not info.value.before_response
    server.close()


async def test_an_ipv6_engine_gets_a_bracketed_host_header() -> None:
    seen: list[str] = []

    async def host(request: web.Request) -> web.Response:
        seen.append(request.headers["Host"])
        return web.Response(body=b"ok")

    app = web.Application()
    app.router.add_get("/host", host)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "::1", 0)
        await site.start()
    except OSError:
        await runner.cleanup()
        pytest.skip("no IPv6 loopback on this machine")
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    pool = UpstreamPool("::1", port)
    try:
        response = await pool.request("GET", "/host")
        assert response.status == 200 and await response.read() == b"ok"  # (aiohttp refuses a bare ::1:port)
        assert seen == [f"[::1]:{port}"]
    finally:
        pool.close()
        await runner.cleanup()
