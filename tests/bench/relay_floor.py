"""The floor for a Python proxy on this stack: aiohttp server + kvgate's upstream client, forwarding bytes
with no parsing, hashing or routing. The overhead benchmark runs it beside the gateway as a baseline.

    python tests/bench/relay_floor.py PORT ENGINE_PORT
"""

from __future__ import annotations

import sys

from aiohttp import web

from gateway.loop import install_best_loop
from gateway.upstream import UpstreamPool


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
    app.router.add_get("/health", health)
    return app


if __name__ == "__main__":
    install_best_loop()
    web.run_app(build(int(sys.argv[2])), host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
