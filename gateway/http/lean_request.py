"""The request the gateway's handlers read (``LeanRequest``), as ``gateway.http.lean_http`` parsed it: method,
path, query, headers, body, and the caller found before the body was read."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

from multidict import CIMultiDictProxy, MultiDict, MultiDictProxy

from gateway.http.lean_http_answering import LeanStream

if TYPE_CHECKING:
    from gateway.http.lean_http_state import LeanConnectionState
    from gateway.tenancy.billing import Caller

EMPTY_QUERY: MultiDictProxy[str] = MultiDictProxy(MultiDict())


class LeanRequest:
    """What the gateway's handlers read of a request: method, path (percent-decoded), query, headers, the
    peer's address and the body; ``match_info``, the path's parameter (``gateway.http.lean_routes``); and,
    with authentication on, its ``caller``, identified before the body was read (the look-up still under
    way when the body was complete first)."""

    __slots__ = (
        "_body",
        "_connection",
        "_query",
        "_target",
        "caller",
        "headers",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "remote",
        "version",
    )

    def __init__(
        self,
        connection: LeanConnectionState,
        method: str,
        path: str,
        headers: CIMultiDictProxy[str],
        body: bytes,
        remote: str | None,
        caller: Caller | asyncio.Task[Caller] | None = None,
        *,
        target: bytes = b"",
        match_info: Mapping[str, str] | None = None,
        version: str = "1.1",
        keep_alive: bool = True,
    ) -> None:
        self._connection = connection
        self.method = method
        self.path = path
        self.headers = headers
        self._body = body
        self.remote = remote
        self.caller = caller
        self._target = target
        self._query: MultiDictProxy[str] | None = None
        self.match_info: Mapping[str, str] = match_info if match_info is not None else {}
        self.version = version
        self.keep_alive = keep_alive  # the connection serves another request after this one's answer

    @property
    def content_length(self) -> int:
        return len(self._body)

    @property
    def query(self) -> MultiDictProxy[str]:
        """The query's parameters (``+`` and escapes decoded, blank values kept), parsed on first use."""
        if self._query is None:
            raw = self._target.partition(b"?")[2].partition(b"#")[0]
            if raw:
                pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True, encoding="utf-8")
                self._query = MultiDictProxy(MultiDict(pairs))
            else:
                self._query = EMPTY_QUERY
        return self._query

    async def read(self) -> bytes:
        return self._body

    def stream_response(self, headers: Mapping[str, str]) -> LeanStream:
        """A 200 stream to this request's client (``prepare``, ``write``, ``write_eof`` as aiohttp's):
        chunked, or to an HTTP/1.0 client unframed, ending with the connection; saying ``Connection:
        close`` when the connection ends after it."""
        return LeanStream(
            self._connection, headers, chunked=self.version != "1.0", closes=not self.keep_alive
        )
