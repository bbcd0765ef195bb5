"""The public port's edge (``[gateway.edge]``), shared by every client connection
(``gateway.http.lean_http``): the read deadlines, the budget of request bodies being read, the connection
caps with their refusal on accept, the key check before a body, and the ``x-request-id`` of every answer
that no handler named."""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, cast

from gateway.http.errors import Unavailable
from gateway.http.http_wire import response_bytes
from gateway.http.retry_after import retry_after_headers

if TYPE_CHECKING:
    from gateway.config_tables import EdgeSettings
    from gateway.tenancy.billing import Caller

REFUSAL_RETRY_AFTER_S = 1  # a connection refused at a cap: one of the client's own may be free by then

# Billing.identify: the Authorization header -> the caller, or a GatewayError (401, 503).
Identify = Callable[[str | None], Coroutine[Any, Any, "Caller"]]
# RequestPreparer.new_request_id: the client's x-request-id header (None: it sent none) -> the answer's id.
RequestId = Callable[[str | None], str]
REQUEST_ID = "x-request-id"


class Edge:
    """What every client connection of the public port shares: the ``[gateway.edge]`` deadlines, the
    connection caps, the key check before a body is read (None: authentication is off), the count of
    requests that did not arrive in time (by phase: header or body) or whose answers went unread (write), and
    ``request_id``, which names every answer no handler named (None: answers go unnamed, as on the operator's
    port): OpenAI names every response, and its SDKs read the name into every error they raise."""

    __slots__ = (
        "body_budget",
        "body_rate",
        "body_s",
        "buffered",
        "header_s",
        "identify",
        "idle_s",
        "limits",
        "request_id",
        "timed_out",
    )

    def __init__(
        self,
        settings: EdgeSettings,
        limits: ConnectionLimits,
        *,
        identify: Identify | None = None,
        timed_out: Callable[[str], None] = lambda phase: None,
        request_id: RequestId | None = None,
    ) -> None:
        self.header_s = settings.header_timeout_s
        self.body_s = settings.body_timeout_s
        self.body_rate = float(settings.body_min_rate)
        self.idle_s = settings.idle_timeout_s
        # Bytes of request bodies being read (not yet whole) on every connection together, and their cap:
        # slow senders with keys the gateway accepts must not hold its memory either.
        self.body_budget = settings.max_buffered_body_bytes
        self.buffered = 0
        self.limits = limits
        self.identify = identify
        self.timed_out = timed_out
        self.request_id = request_id

    def body_deadline(self, began: float, received: int) -> float:
        """When a body begun at ``began`` with ``received`` bytes so far is late (mod_reqtimeout's rule)."""
        return began + self.body_s + (received / self.body_rate if self.body_rate else 0.0)


class ConnectionLimits:
    """Open client connections, in all and per client address (an IPv4 address, an IPv6 /64), and the
    refusal past either cap: a 503 with Retry-After written on accept and the connection closed, without
    waiting for a request. O(1) a connection: a counter, and a dict entry per address with connections open.
    Clients in ``exempt`` networks (loopback, trusted proxies) count only towards the total. ``request_id``
    names each refusal (None: unnamed)."""

    def __init__(
        self,
        *,
        max_total: int,
        max_per_client: int,
        exempt: Iterable[str] = (),
        refused: Callable[[str], None] = lambda reason: None,
        request_id: RequestId | None = None,
    ) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.open = 0
        self._exempt = [ipaddress.ip_network(n, strict=False) for n in exempt]
        self._per_client: dict[str, int] = {}
        self._keys: dict[str, str] = {}  # peer address -> its client key ("" when exempt), remembered
        self._refused = refused
        self._request_id = request_id
        # reason -> (second, the 503's status line, the rest of it), built once a second: each refusal's own
        # x-request-id goes between them.
        self._answers: dict[str, tuple[int, bytes, bytes]] = {}

    def admit(self, transport: asyncio.BaseTransport, peer: Any) -> str | None:
        """The connection's client key ("": not counted per client) to ``release`` when it closes; None if
        it was refused (answered and closed here)."""
        if self.open >= self.max_total:
            self._refuse(transport, "total")
            return None
        client = self._client(peer)
        if client:
            count = self._per_client.get(client, 0)
            if count >= self.max_per_client:
                self._refuse(transport, "per_client")
                return None
            self._per_client[client] = count + 1
        self.open += 1
        return client

    def release(self, client: str) -> None:
        self.open -= 1
        if client:
            count = self._per_client[client] - 1
            if count:
                self._per_client[client] = count
            else:
                del self._per_client[client]

    def note_refused(self, reason: str) -> None:
        """Count a refusal made elsewhere (a body past the edge's body budget)."""
        self._refused(reason)

    def clients(self) -> int:
        """Client addresses with connections open (exempt ones aside)."""
        return len(self._per_client)

    def _client(self, peer: Any) -> str:
        if not isinstance(peer, tuple | list) or not peer:
            return ""  # a Unix socket: nobody to tell apart
        host = str(peer[0])
        key = self._keys.get(host)
        if key is None:
            if len(self._keys) >= 65536:  # a flood from many addresses: remember afresh
                self._keys.clear()
            key = self._keys[host] = self._key(host)
        return key

    def _key(self, host: str) -> str:
        try:
            address = ipaddress.ip_address(host.partition("%")[0])
        except ValueError:
            return host
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack socket's IPv4 client
        if any(address in network for network in self._exempt):
            return ""
        if isinstance(address, ipaddress.IPv6Address):
            return str(ipaddress.IPv6Network((address, 64), strict=False))  # one client's /64
        return str(address)

    def _refuse(self, transport: asyncio.BaseTransport, reason: str) -> None:
        self._refused(reason)
        now = int(time.time())
        answer = self._answers.get(reason)
        if answer is None or answer[0] != now:
            if reason == "total":
                message = f"the gateway is at its limit of {self.max_total} open connections; retry shortly"
            else:
                message = (
                    f"too many connections from your address (at most {self.max_per_client} at a time); "
                    "reuse them, or retry shortly"
                )
            error = Unavailable(
                message, code="too_many_connections", headers=retry_after_headers(REFUSAL_RETRY_AFTER_S)
            )
            status, end, rest = response_bytes(error.response(), keep_alive=False).partition(b"\r\n")
            answer = self._answers[reason] = (now, status + end, rest)
        _, status_line, rest = answer
        if self._request_id is not None:
            status_line += f"{REQUEST_ID}: {self._request_id(None)}\r\n".encode("latin-1")
        cast(asyncio.WriteTransport, transport).write(status_line + rest)
        transport.close()  # after the write is flushed
