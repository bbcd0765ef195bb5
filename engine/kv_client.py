"""A blocking HTTP/1.1 client for one KV transfer's body, read straight into the caller's buffers.

``KvImporter`` runs it on a worker thread: a frame's payload is read with ``recv_into`` into the staging
buffer it is scattered from, where aiohttp's client would hand the body over as new bytes objects (the
socket's copy, then its chunked parser's, then the caller's), and nothing of the transfer runs on the event
loop. Connections are kept alive: one whose response was read to its end goes back to a pool (per peer)
that the next transfer to that peer takes it from, so a stream of transfers opens one TCP connection (and
one TLS handshake) instead of one each; a pooled connection the peer has closed meanwhile is dropped, or
the request is sent again on a new one if it failed before any byte of the answer. ``abort`` (from any
thread) makes a blocked read fail at once.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from urllib.parse import urlsplit

from engine.kv_wire import KvTransferError

_SCRATCH = 64 << 10  # status line, headers, chunk lines, frame headers: read ahead into this
_MAX_HEAD = 64 << 10  # the response's status line and headers at most
_DRAIN_S = 1.0  # the most close() waits for the end of a body the caller read all frames of

Peer = tuple[bool, str, int]  # (https, host, port)


class ConnectionPool:
    """Idle keep-alive connections, per peer: at most ``per_peer`` each, none older than ``idle_s``
    (servers close idle connections themselves: aiohttp's after 75 s)."""

    def __init__(self, per_peer: int = 4, idle_s: float = 30.0) -> None:
        self.per_peer = per_peer
        self.idle_s = idle_s
        self._idle: dict[Peer, list[tuple[float, socket.socket]]] = {}
        self._lock = threading.Lock()
        self.opened = 0  # connections made (for tests and metrics)

    def take(self, peer: Peer) -> socket.socket | None:
        """The most recently used idle connection to ``peer`` that still looks open, or None."""
        while True:
            with self._lock:
                idle = self._idle.get(peer)
                if not idle:
                    return None
                since, sock = idle.pop()
            if time.monotonic() - since < self.idle_s and _looks_open(sock):
                return sock
            sock.close()

    def give(self, peer: Peer, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            idle.append((time.monotonic(), sock))
            dropped = idle[: -self.per_peer] if len(idle) > self.per_peer else []
            del idle[: len(dropped)]
        for _, old in dropped:
            old.close()

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for entries in idle.values():
            for _, sock in entries:
                sock.close()


def _looks_open(sock: socket.socket) -> bool:
    """An idle connection has nothing to read: readable means the peer closed it (or broke protocol)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


POOL = ConnectionPool()


class HttpBodyReader:
    def __init__(
        self,
        url: str,
        body: bytes,
        *,
        content_type: str = "application/json",
        connect_timeout_s: float = 5.0,
        timeout_s: float = 60.0,
        pool: ConnectionPool | None = POOL,  # None: a connection of its own, closed at the end
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise KvTransferError(f"cannot fetch K/V from {url!r}")
        self.url = url
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._pool = pool
        self._peer: Peer = (self._https, self._host, self._port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]  # never credentials in the Host header
        self._request = (
            f"POST {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: {'close' if pool is None else 'keep-alive'}\r\n"
            "User-Agent: kvgate-kv-import\r\n\r\n"
        ).encode("latin-1") + body
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._aborted = False
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._lo = self._hi = 0  # read-ahead bytes: self._scratch[self._lo : self._hi]
        self._chunked = False
        self._remaining = -1  # of the current chunk, or of a Content-Length body; -1: until the socket closes
        self._ended = False
        self.status = 0
        self.headers: dict[str, str] = {}

    # -- the exchange -------------------------------------------------------------------------------------

    def open(self) -> int:
        """Connect (or take a pooled connection), send the request, read the status line and headers;
        returns the status."""
        if self._aborted:
            raise KvTransferError(f"the KV transfer from {self.url} was aborted")
        reused = self._pool.take(self._peer) if self._pool is not None else None
        if reused is not None:
            try:
                status_line = self._exchange(reused)
            except (OSError, KvTransferError):
                if self._aborted or self._hi:  # aborted, or the peer answered something: not a stale socket
                    raise
                self.close()  # the peer closed it while we sent: send again on a new connection
                status_line = self._exchange(self._connect())
        else:
            status_line = self._exchange(self._connect())
        fields = status_line.split(b" ", 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or not fields[1].isdigit():
            raise KvTransferError(f"{self.url} answered {status_line[:80]!r}, not HTTP/1.x")
        self.status = int(fields[1])
        size = len(status_line)
        while line := self._line():
            size += len(line)
            if size > _MAX_HEAD:
                raise KvTransferError(f"{self.url} answered with over {_MAX_HEAD} bytes of headers")
            name, sep, value = line.partition(b":")
            if not sep:
                raise KvTransferError(f"malformed header line {line[:80]!r} from {self.url}")
            self.headers[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
        coding = self.headers.get("transfer-encoding", "").lower()
        if coding:
            if coding.rsplit(",", 1)[-1].strip() != "chunked":
                raise KvTransferError(f"{self.url} answered with transfer-encoding {coding!r}")
            self._chunked, self._remaining = True, 0
        elif "content-length" in self.headers:
            try:
                self._remaining = int(self.headers["content-length"])
            except ValueError:
                raise KvTransferError(f"{self.url} answered a bad content-length") from None
        return self.status

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self._host, self._port), timeout=self._connect_timeout_s)
        try:
            if self._https:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            sock.close()
            raise
        if self._pool is not None:
            self._pool.opened += 1
        return sock

    def _exchange(self, sock: socket.socket) -> bytes:
        """Send the request on ``sock``; its answer's status line."""
        sock.settimeout(self._timeout_s)
        self._sock = sock
        if self._aborted:  # aborted while connecting
            self.abort()
        sock.sendall(self._request)
        return self._line()

    def readinto(self, buf: memoryview) -> None:
        """Fill ``buf`` with the next body bytes; KvTransferError if the body ends first."""
        got, want = 0, buf.nbytes
        while got < want:
            if self._remaining == 0 and not self._next_chunk():
                raise KvTransferError(f"the KV transfer from {self.url} ended early")
            n = want - got if self._remaining < 0 else min(want - got, self._remaining)
            n = self._read_some(buf[got : got + n])
            got += n
            if self._remaining > 0:
                self._remaining -= n

    def read_exact(self, n: int) -> bytes:
        out = bytearray(n)
        self.readinto(memoryview(out))
        return bytes(out)

    def read_text(self, limit: int) -> str:
        """Up to ``limit`` bytes of what is left of the body, as text (an error answer)."""
        out = bytearray()
        with contextlib.suppress(KvTransferError, OSError):
            while len(out) < limit:
                if self._remaining == 0 and not self._next_chunk():
                    break
                n = limit - len(out) if self._remaining < 0 else min(limit - len(out), self._remaining)
                piece = bytearray(n)
                n = self._read_some(memoryview(piece))
                out += piece[:n]
                if self._remaining > 0:
                    self._remaining -= n
        return out.decode("utf-8", "replace")

    def abort(self) -> None:
        """Make a read blocked in another thread fail now (and every later one)."""
        self._aborted = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Done with the exchange: the connection goes back to the pool if its answer was read to the end
        (a chunked body's last frame read, its closing chunk is waited for a moment), else it is closed."""
        sock = self._sock
        if sock is None:
            return
        reusable = self._pool is not None and self._finished()
        self._sock = None
        if reusable and self._pool is not None:
            sock.settimeout(self._timeout_s)
            self._pool.give(self._peer, sock)
        else:
            sock.close()

    def _finished(self) -> bool:
        if self._aborted or not self.status or "close" in self.headers.get("connection", "").lower():
            return False
        try:
            if self._chunked and not self._ended and self._remaining == 0:
                assert self._sock is not None
                self._sock.settimeout(_DRAIN_S)
                if self._next_chunk():
                    return False  # the caller left part of the body unread
        except (OSError, KvTransferError):
            return False
        done = self._ended if self._chunked else self._remaining == 0
        return done and self._lo == self._hi  # nothing of a next answer read ahead

    # -- framing ------------------------------------------------------------------------------------------

    def _next_chunk(self) -> bool:
        """Step to the next chunk of a chunked body; False at the body's end."""
        if not self._chunked or self._ended:
            return False
        line = self._line()
        if not line:  # the CRLF that ends the previous chunk's data
            line = self._line()
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise KvTransferError(f"malformed chunk from {self.url}: {line[:40]!r}") from None
        if size == 0:
            while self._line():  # trailer fields, then the blank line that ends the body
                pass
            self._ended = True
            return False
        self._remaining = size
        return True

    def _line(self) -> bytes:
        """The next CRLF-terminated line of the raw stream, without its CRLF."""
        while True:
            end = self._scratch.find(b"\r\n", self._lo, self._hi)
            if end >= 0:
                line = bytes(self._view[self._lo : end])
                self._lo = end + 2
                return line
            if self._hi - self._lo >= _SCRATCH - 1:
                raise KvTransferError(f"a line of over {_SCRATCH} bytes from {self.url}")
            self._fill()

    def _fill(self) -> None:
        """Read more of the raw stream into the scratch buffer (moving what is left to its front)."""
        if self._lo:
            left = self._hi - self._lo
            self._view[:left] = self._view[self._lo : self._hi]
            self._lo, self._hi = 0, left
        self._hi += self._recv(self._view[self._hi :])

    def _read_some(self, buf: memoryview) -> int:
        """Up to ``len(buf)`` raw bytes into ``buf``: what was read ahead first, else straight from the
        socket (one ``recv_into``: the kernel's copy is the only one)."""
        if self._hi > self._lo:
            n = min(buf.nbytes, self._hi - self._lo)
            buf[:n] = self._view[self._lo : self._lo + n]
            self._lo += n
            return n
        return self._recv(buf)

    def _recv(self, buf: memoryview) -> int:
        if self._sock is None or self._aborted:
            raise KvTransferError(f"the KV transfer from {self.url} was aborted")
        n = self._sock.recv_into(buf)
        if n == 0:
            if self._aborted:
                raise KvTransferError(f"the KV transfer from {self.url} was aborted")
            raise KvTransferError(f"the KV transfer from {self.url} broke: the connection closed")
        return n
