"""A blocking HTTP/1.1 client for one KV transfer's body, read straight into the caller's buffers.

``KvImporter`` runs it on a worker thread: a frame's payload is read with ``recv_into`` into the staging
buffer it is scattered from, where aiohttp's client would hand the body over as new bytes objects (the
socket's copy, then its chunked parser's, then the caller's), and nothing of the transfer runs on the event
loop. One request per connection (``Connection: close``): a transfer is megabytes, a connect is nothing
beside it. ``abort`` (from any thread) makes a blocked read fail at once.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from urllib.parse import urlsplit

from engine.kv_wire import KvTransferError

_SCRATCH = 64 << 10  # status line, headers, chunk lines, frame headers: read ahead into this
_MAX_HEAD = 64 << 10  # the response's status line and headers at most


class HttpBodyReader:
    def __init__(
        self,
        url: str,
        body: bytes,
        *,
        content_type: str = "application/json",
        connect_timeout_s: float = 5.0,
        timeout_s: float = 60.0,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise KvTransferError(f"cannot fetch K/V from {url!r}")
        self.url = url
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]  # never credentials in the Host header
        self._request = (
            f"POST {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nUser-Agent: kvgate-kv-import\r\n\r\n"
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
        """Connect, send the request, read the status line and headers; returns the status."""
        if self._aborted:
            raise KvTransferError(f"the KV transfer from {self.url} was aborted")
        sock = socket.create_connection((self._host, self._port), timeout=self._connect_timeout_s)
        try:
            if self._https:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host)
            sock.settimeout(self._timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        if self._aborted:  # aborted while connecting
            self.abort()
        sock.sendall(self._request)
        status_line = self._line()
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
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

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
