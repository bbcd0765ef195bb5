"""A lean HTTP/1.1 client for talking to engines: pooled keep-alive connections over asyncio.Protocol.

aiohttp's ClientSession costs ~0.2 ms of CPU per request here, most of the gateway's budget; this client
writes the request in one call, parses the response with httptools' C parser, and hands body bytes to the
caller in batches. A body consumer that falls behind pauses the socket (bounded memory for slow clients).

``https://`` engines get TLS (verified against the process's one engine context, ``engine_tls_context``);
the handshake happens once per pooled connection, so plain ``http://`` and reused TLS connections pay
nothing per request. A refused certificate is an ``UpstreamConnectError``, like a refused connection.

Here: the connections (``UpstreamConnection``), their pool per engine and the pools per base URL. The
response is ``gateway.http.upstream_response``'s, the errors ``gateway.http.upstream_errors``', the TLS
context ``gateway.http.upstream_tls``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from gateway.http.upstream_errors import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.http.upstream_response import Response, expire_waiter
from gateway.http.upstream_tls import engine_tls_context, tls_failure_reason


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection; serves one exchange at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._parser = httptools.HttpResponseParser(self)
        self._response: Response | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but they implement the interface.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._response is None:
            # Bytes nobody asked for (a broken engine): this connection can no longer be trusted.
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("engine tried to upgrade the connection"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"malformed response from engine: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool._forget(self)
        if self._response is not None and not self._response.complete:
            self._response._fail(UpstreamClosed("engine closed the connection mid-response"))
            self._response = None

    # -- httptools callbacks ---------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._response is not None
        self._response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self._response
        assert response is not None
        response.status = self._parser.get_status_code()
        response.keep_alive = self._parser.should_keep_alive()
        if not response._headers.done():
            response._headers.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self._response is not None
        self._response._feed(body)

    def on_message_complete(self) -> None:
        response = self._response
        assert response is not None
        self._response = None
        response._finish()
        if response.keep_alive and not self.closed:
            self.reused = True
            self._pool._release(self)
        else:
            self.close()

    # --------------------------------------------------------------------------------------------------

    def start(self, response: Response, payload: bytes) -> None:
        assert self.transport is not None and self._response is None
        self._response = response
        response._connection = self
        self.transport.write(payload)

    def _fail(self, error: UpstreamError) -> None:
        response, self._response = self._response, None
        if response is not None:
            response._fail(error)
        self.close()

    def close(self) -> None:
        self.closed = True
        self._pool._forget(self)
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        self._pool._forget(self)
        self._response = None
        if self.transport is not None:
            self.transport.abort()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()


class UpstreamPool:
    """Keep-alive connections to one engine (host, port), over TLS when given ``ssl_context``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout: float = 5.0,
        max_idle: int = 512,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self._max_idle = max_idle
        self._idle: deque[UpstreamConnection] = deque()
        self._all: set[UpstreamConnection] = set()
        named = f"[{host}]" if ":" in host else host  # an IPv6 literal is bracketed in a Host header
        self._host_header = f"Host: {named}:{port}\r\n".encode()
        # Decided once: a plain pool's connect is exactly what it was before TLS existed.
        self._connect_kwargs: dict[str, Any] = (
            {} if ssl_context is None else {"ssl": ssl_context, "server_hostname": host}
        )

    @property
    def open_connections(self) -> int:
        return len(self._all)

    def _release(self, conn: UpstreamConnection) -> None:
        if len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    def _forget(self, conn: UpstreamConnection) -> None:
        self._all.discard(conn)
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    async def _connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            # The timeout covers the TLS handshake too: an engine that accepts and then stalls is down.
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self), self.host, self.port, **self._connect_kwargs
                )
        except TimeoutError:
            raise UpstreamConnectError(f"connect to {self.host}:{self.port} timed out") from None
        except ssl.SSLError as exc:  # before OSError, its base: a refused certificate is no socket error
            raise UpstreamConnectError(
                f"TLS handshake with {self.host}:{self.port} failed: {tls_failure_reason(exc)}"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(
                f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        self._all.add(conn)
        return conn

    def build_head(self, method: str, path: str, headers: list[tuple[str, str]], body_length: int) -> bytes:
        lines = [f"{method} {path} HTTP/1.1\r\n".encode(), self._host_header]
        lines.extend(f"{k}: {v}\r\n".encode() for k, v in headers)
        lines.append(b"Content-Length: %d\r\n\r\n" % body_length)
        return b"".join(lines)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: list[tuple[str, str]] | None = None,
        *,
        header_timeout: float | None = None,
        started: Callable[[Response], None] | None = None,
    ) -> Response:
        """Send a request; returns once the response's status and headers have arrived. ``started`` gets
        the response as soon as the request is on its way (to fail it early: ``Response.engine_down``)."""
        payload = self.build_head(method, path, headers or [], len(body)) + body
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            conn = None
            while self._idle:
                candidate = self._idle.pop()
                if not candidate.closed:
                    conn = candidate
                    break
            if conn is None:
                conn = await self._connect()
            response = Response(loop)
            conn.start(response, payload)
            if started is not None:
                started(response)
            timer = None
            if header_timeout is not None:
                timer = loop.call_later(header_timeout, expire_waiter, response._headers)
            try:
                await response._headers
                return response
            except UpstreamTimeout:
                conn.abort()
                raise
            except UpstreamClosed:
                # A pooled connection the engine had just closed: retry once on a fresh one (the loop goes
                # on). Nothing of the request was processed (no response byte came back).
                if not (attempt == 0 and conn.reused and not response.received_any):
                    raise
            except asyncio.CancelledError:
                conn.abort()
                raise
            finally:
                if timer is not None:
                    timer.cancel()
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        self._all.clear()


class UpstreamClients:
    """One pool per engine base URL (http://host:port or https://host:port).

    ``ssl_context`` verifies every ``https://`` engine (``engine_tls_context``); None: the system's CAs.
    """

    def __init__(self, *, connect_timeout: float = 5.0, ssl_context: ssl.SSLContext | None = None) -> None:
        self._pools: dict[str, UpstreamPool] = {}
        self._connect_timeout = connect_timeout
        self._ssl_context = ssl_context

    @property
    def ssl_context(self) -> ssl.SSLContext:
        """The context for TLS to engines; the gateway's other clients to engines share it."""
        if self._ssl_context is None:
            self._ssl_context = engine_tls_context()
        return self._ssl_context

    def pool(self, base_url: str) -> UpstreamPool:
        pool = self._pools.get(base_url)
        if pool is None:
            host, port, tls = split_base_url(base_url)
            pool = self._pools[base_url] = UpstreamPool(
                host,
                port,
                connect_timeout=self._connect_timeout,
                ssl_context=self.ssl_context if tls else None,
            )
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def split_base_url(base_url: str) -> tuple[str, int, bool]:
    """(host, port, whether over TLS) of an engine's ``http://`` or ``https://`` base URL."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine URL must be http://host[:port] or https://host[:port], got {base_url!r}")
    tls = parts.scheme == "https"
    return parts.hostname, parts.port or (443 if tls else 80), tls
