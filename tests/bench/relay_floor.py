"""The floor for a Python proxy on this stack: aiohttp server + kvgate's upstream client, forwarding bytes
with no parsing, hashing or routing. The overhead benchmark runs it beside the gateway as a baseline.
With ``--httptools`` the server is a bare asyncio protocol parsing with httptools and writing answers on the
transport (what gateway.http.lean_http does for every request): the floor below aiohttp.

    python tests/bench/relay_floor.py PORT ENGINE_PORT [--httptools]
"""

from __future__ import annotations

import asyncio
import sys

import httptools
from aiohttp import web

from gateway.http.loop import install_best_loop
from gateway.http.upstream import UpstreamPool


def build(engine_port: int) -> web.Application:
    pool = UpstreamPool("127.0.0.1", engine_port)

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        upstream = await pool.request("POST", request.path, body, [("Content-Type", "application/json")])
        if upstream.header(b"content-type") == b"text/event-stream" or not upstream.header(b"content-length"):
            response = web.StreamResponse(status=upstream.status)
            response.content_type = "text/event-stream"
            await response.prepare(request)
            async for batch in upstream.iter_batches(30):
                await response.write(batch)
            await response.write_eof()
            return response
        return web.Response(
            body=await upstream.read(30), status=upstream.status, content_type="application/json"
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_post("/v1/completions", relay)
    app.router.add_get("/health", health)
    return app


class RawRelay(asyncio.Protocol):
    """One client connection, one request at a time (the benchmark's client never pipelines)."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        asyncio.get_running_loop().create_task(self.relay(self.url.decode(), b"".join(self.body)))

    async def relay(self, path: str, body: bytes) -> None:
        assert self.transport is not None
        if path == "/health":
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            return
        upstream = await self.pool.request("POST", path, body, [("Content-Type", "application/json")])
        status = b"HTTP/1.1 %d OK\r\n" % upstream.status
        if upstream.header(b"content-type") == b"text/event-stream" or not upstream.header(b"content-length"):
            self.transport.write(
                status + b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            async for batch in upstream.iter_batches(30):
                self.transport.write(b"%x\r\n%s\r\n" % (len(batch), batch))
            self.transport.write(b"0\r\n\r\n")
            return
        data = await upstream.read(30)
        head = b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
        self.transport.write(status + head + data)


async def serve_raw(port: int, engine_port: int) -> None:
    pool = UpstreamPool("127.0.0.1", engine_port)
    server = await asyncio.get_running_loop().create_server(lambda: RawRelay(pool), "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    install_best_loop()
    if "--httptools" in sys.argv[3:]:
        asyncio.run(serve_raw(int(sys.argv[1]), int(sys.argv[2])))
    else:
        web.run_app(
            build(int(sys.argv[2])), host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None
        )
