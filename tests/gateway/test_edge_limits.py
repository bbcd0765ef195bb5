"""The public port's edge (``[gateway.edge]``): read deadlines for slow clients, connection caps, and the
key checked before a body is read; on a connection's first request and on one kept alive after a GET.
Raw sockets against a real gateway, with deadlines of a second or so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.http.edge import ConnectionLimits
from gateway.http.server import GatewayServer
from gateway.tenancy.tenants import create_key
from tests.harness import MODEL, Cluster, ClusterFactory
from tests.raw_http import Replies, Reply

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CHAT_BODY = json.dumps(CHAT).encode()
DEADLINES = {"header_timeout_s": 1.0, "body_timeout_s": 1.0}
MODES = ["fresh", "after_get"]  # the slow request is the connection's first, or follows a GET answered on it
DRIP_S = 0.2
EIGHT_MIB = 8 << 20


class Client:
    """A raw HTTP/1.1 connection: bytes out as they are given, responses parsed as they come."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.closed = False
        self._replies = Replies()
        self.replies = self._replies.done

    @classmethod
    async def connect(cls, cluster: Cluster) -> Client:
        host, port = cluster.url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def _read(self) -> bool:
        try:
            data = await self.reader.read(65536)
        except ConnectionError:
            data = b""
        if not data:
            self.closed = True
            return False
        self._replies.feed(data)
        return True

    async def replies_until(self, count: int, within_s: float = 10.0) -> list[Reply]:
        async with asyncio.timeout(within_s):
            while len(self.replies) < count and await self._read():
                pass
        return self.replies

    async def until_closed(self, within_s: float = 10.0) -> list[Reply]:
        """Everything the server writes until it closes the connection."""
        async with asyncio.timeout(within_s):
            while await self._read():
                pass
        return self.replies

    async def drip(self, data: bytes, every_s: float = DRIP_S) -> None:
        """``data`` a byte at a time, until it is all sent or the server has closed the connection."""
        for i in range(len(data)):
            if self.closed:
                return
            try:
                await self.send(data[i : i + 1])
            except ConnectionError:
                return
            await asyncio.sleep(every_s)

    def close(self) -> None:
        self.writer.close()


def post(path: str, body: bytes, *headers: str, length: int | None = None, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: test", "Content-Type: application/json", *headers]
    head.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def get(path: str, *headers: str) -> bytes:
    return ("\r\n".join([f"GET {path} HTTP/1.1", "Host: test", *headers]) + "\r\n\r\n").encode()


CHAT_REQUEST = post("/v1/chat/completions", CHAT_BODY)


def server(cluster: Cluster) -> GatewayServer:
    runner = cluster._runners[-1]  # the gateway's
    assert isinstance(runner.server, GatewayServer)
    return runner.server


def limits(cluster: Cluster) -> ConnectionLimits:
    edge = server(cluster).edge
    assert edge is not None
    return edge.limits


async def gateway(make_cluster: ClusterFactory, mode: str = "fresh", **settings: Any) -> Cluster:
    return await make_cluster({"eu-west": 1}, **settings)


async def client_for(cluster: Cluster, mode: str) -> Client:
    """A connection in ``mode``: ``after_get``, it has served a GET and is kept alive."""
    client = await Client.connect(cluster)
    if mode == "after_get":
        await client.send(get("/health"))
        replies = await client.replies_until(1)
        assert replies[0].status == 200
        assert len(server(cluster).lean_connections) == 1
    return client


async def served_meanwhile(cluster: Cluster, slow: Awaitable[list[Reply]]) -> list[Reply]:
    """While ``slow`` waits on its deadline, another client's request is answered as usual."""
    task = asyncio.ensure_future(slow)
    other = await Client.connect(cluster)
    try:
        await other.send(CHAT_REQUEST)
        replies = await other.replies_until(1)
        assert replies[0].status == 200 and replies[0].json()["object"] == "chat.completion"
        assert not task.done()  # the slow one is still waiting
    finally:
        other.close()
    return await task


def assert_timed_out(replies: list[Reply], client: Client, already: int = 0) -> None:
    assert client.closed
    assert len(replies) == already + 1, [r.status for r in replies]
    reply = replies[-1]
    assert reply.status == 408, reply.body
    assert reply.json()["error"]["code"] == "request_timeout"
    assert reply.headers.get("connection") == "close"


def timeouts(cluster: Cluster, phase: str) -> float:
    return cluster.gateway.metrics.read_timeouts.labels(phase).value


# -- read deadlines ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_a_partial_request_line_gets_408_at_its_deadline(
    make_cluster: ClusterFactory, mode: str
) -> None:
    cluster = await gateway(make_cluster, mode, edge=DEADLINES)
    client = await client_for(cluster, mode)
    already = len(client.replies)
    await client.send(b"POST /v1/chat/compl")
    replies = await served_meanwhile(cluster, client.until_closed(within_s=8))
    assert_timed_out(replies, client, already)
    assert timeouts(cluster, "header") == 1


async def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline(
    make_cluster: ClusterFactory,
) -> None:
    """A connection holds a file descriptor: one that never sends its first request frees it at the header
    deadline (as nginx's client_header_timeout), not at the keep-alive idle timeout."""
    cluster = await gateway(make_cluster, edge={**DEADLINES, "idle_timeout_s": 60})
    client = await Client.connect(cluster)
    assert await served_meanwhile(cluster, client.until_closed(within_s=8)) == []  # closed, nothing said
    assert limits(cluster).open == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_dripped_header_gets_408_at_its_deadline(make_cluster: ClusterFactory, mode: str) -> None:
    """A byte every 0.2 s: each one arrives in time, the head as a whole does not (1 s)."""
    cluster = await gateway(make_cluster, mode, edge=DEADLINES)
    client = await client_for(cluster, mode)
    already = len(client.replies)
    drip = asyncio.ensure_future(client.drip(CHAT_REQUEST))
    try:
        replies = await served_meanwhile(cluster, client.until_closed(within_s=8))
    finally:
        drip.cancel()
    assert_timed_out(replies, client, already)
    assert timeouts(cluster, "header") == 1


@pytest.mark.parametrize("mode", MODES)
async def test_a_dripped_body_gets_408_at_its_deadline(make_cluster: ClusterFactory, mode: str) -> None:
    """Headers at once, the body at 5 bytes/s: far under body_min_rate, so cut off after body_timeout_s."""
    cluster = await gateway(make_cluster, mode, edge=DEADLINES)
    client = await client_for(cluster, mode)
    already = len(client.replies)
    await client.send(post("/v1/chat/completions", b"", length=len(CHAT_BODY)))
    drip = asyncio.ensure_future(client.drip(CHAT_BODY))
    try:
        replies = await served_meanwhile(cluster, client.until_closed(within_s=8))
    finally:
        drip.cancel()
    assert_timed_out(replies, client, already)
    assert timeouts(cluster, "body") == 1


@pytest.mark.parametrize("mode", MODES)
async def test_the_body_allowance_grows_with_the_bytes_received(
    make_cluster: ClusterFactory, mode: str
) -> None:
    """body_min_rate (200 bytes/s here) extends the 0.5 s allowance by 1 s per 200 bytes: a body sent at
    1,000 bytes/s for 2 s completes; one sent at 20 bytes/s is cut off."""
    edge = {"header_timeout_s": 1.0, "body_timeout_s": 0.5, "body_min_rate": 200}
    cluster = await gateway(make_cluster, mode, edge=edge)
    client = await client_for(cluster, mode)
    padded = {**CHAT, "messages": [{"role": "user", "content": "hi " * 650}]}
    body = json.dumps(padded).encode()
    assert len(body) > 1900
    await client.send(post("/v1/chat/completions", b"", length=len(body)))
    for i in range(0, len(body), 100):
        await client.send(body[i : i + 100])
        await asyncio.sleep(0.1)
    replies = await client.replies_until(len(client.replies) + 1)
    assert replies[-1].status == 200, replies[-1].body
    already = len(replies)
    await client.send(post("/v1/chat/completions", b"", length=len(body)))
    drip = asyncio.ensure_future(client.drip(body, every_s=0.05))
    try:
        replies = await client.until_closed(within_s=8)
    finally:
        drip.cancel()
    assert_timed_out(replies, client, already)
    assert timeouts(cluster, "body") == 1


async def test_an_answer_longer_than_the_deadlines_is_not_cut_and_idle_connections_close(
    make_cluster: ClusterFactory,
) -> None:
    """Deadlines bound reading a request, not answering it or waiting for the next: requests spaced wider
    than the 0.5 s deadlines on one keep-alive connection, and a stream of about 2 s, all end whole and the
    connection stays usable; once idle past idle_timeout_s it is closed."""
    edge = {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "idle_timeout_s": 1.5}
    cluster = await gateway(make_cluster, edge=edge)
    client = await Client.connect(cluster)
    for i in range(3):
        await client.send(CHAT_REQUEST)
        assert (await client.replies_until(i + 1))[i].status == 200
        await asyncio.sleep(0.7)
    stream = {**CHAT, "stream": True, "max_tokens": 4000}  # 0.5 ms a token
    await client.send(post("/v1/chat/completions", json.dumps(stream).encode()))
    await client.send(CHAT_REQUEST)  # pipelined: its head and body wait in the buffers meanwhile
    replies = await client.replies_until(5, within_s=20)
    assert replies[3].status == 200 and replies[3].body.endswith(b"data: [DONE]\n\n")
    assert replies[4].status == 200
    await client.until_closed(within_s=6)
    assert client.closed and len(client.replies) == 5
    assert timeouts(cluster, "header") == timeouts(cluster, "body") == 0


# -- connection caps --------------------------------------------------------------------------------------


async def open_held(cluster: Cluster, count: int) -> list[Client]:
    """``count`` keep-alive connections, each answered once (so the gateway has surely counted it)."""
    clients = []
    for _ in range(count):
        client = await Client.connect(cluster)
        await client.send(CHAT_REQUEST)
        assert (await client.replies_until(1))[0].status == 200
        clients.append(client)
    return clients


async def assert_refused(cluster: Cluster) -> None:
    client = await Client.connect(cluster)
    try:
        replies = await client.until_closed(within_s=5)  # answered on accept: no request needed
    finally:
        client.close()
    assert len(replies) == 1 and replies[0].status == 503
    assert replies[0].headers.get("connection") == "close"
    assert replies[0].headers.get("retry-after") == "1"
    assert replies[0].headers.get("retry-after-ms") == "1000"
    assert replies[0].json()["error"]["code"] == "too_many_connections"


async def assert_served(cluster: Cluster, request: bytes = CHAT_REQUEST) -> None:
    client = await Client.connect(cluster)
    try:
        await client.send(request)
        replies = await client.replies_until(1)
        assert replies[0].status == 200, replies[0].body
    finally:
        client.close()


@pytest.mark.parametrize(
    ("cap", "reason"),
    [
        ({"max_connections_per_client": 3, "per_client_exempt": []}, "per_client"),
        ({"max_connections": 3}, "total"),
    ],
)
async def test_connections_past_a_cap_get_503_on_accept(
    make_cluster: ClusterFactory, cap: dict[str, Any], reason: str
) -> None:
    cluster = await gateway(make_cluster, edge=cap)
    held = await open_held(cluster, 3)
    await assert_refused(cluster)
    await assert_refused(cluster)
    metrics = cluster.gateway.metrics
    assert metrics.connections_refused.labels(reason).value == 2
    assert metrics.open_connections() == 3
    held.pop().close()  # one frees a slot
    await cluster.wait_for(lambda: limits(cluster).open == 2)
    await assert_served(cluster)
    await cluster.wait_for(lambda: limits(cluster).open == 2)
    for client in held:
        client.close()
    await cluster.wait_for(lambda: limits(cluster).open == 0)
    assert limits(cluster).clients() == 0  # no per-client entry outlives its connections
    await assert_served(cluster, get("/health"))


async def test_a_connection_holds_one_slot_whatever_it_serves(make_cluster: ClusterFactory) -> None:
    """A connection that served a GET, then completions, then a 404, is counted once and released once."""
    cluster = await gateway(make_cluster, edge={"max_connections_per_client": 2, "per_client_exempt": []})
    mixed = await client_for(cluster, "after_get")
    await mixed.send(CHAT_REQUEST + get("/nowhere"))
    assert [r.status for r in await mixed.replies_until(3)] == [200, 200, 404]
    other = await Client.connect(cluster)
    await other.send(CHAT_REQUEST)
    assert (await other.replies_until(1))[0].status == 200
    await assert_refused(cluster)
    assert limits(cluster).open == 2
    mixed.close()
    other.close()
    await cluster.wait_for(lambda: limits(cluster).open == 0)
    assert limits(cluster).clients() == 0


# -- the key before the body ------------------------------------------------------------------------------


async def authed(make_cluster: ClusterFactory, **settings: Any) -> tuple[Cluster, str]:
    cluster = await make_cluster({"eu-west": 1}, auth={"enabled": True}, tenants={"acme": {}}, **settings)
    key, _ = await create_key(cluster.gateway.billing.keys, "acme")
    return cluster, key


async def first_reply(cluster: Cluster, request: bytes, within_s: float = 5.0) -> tuple[Reply, Client]:
    client = await Client.connect(cluster)
    await client.send(request)
    replies = await client.replies_until(1, within_s)
    assert replies, "closed without an answer"
    return replies[0], client


async def test_a_refused_key_gets_401_before_the_body_is_sent(make_cluster: ClusterFactory) -> None:
    """Headers announcing 8 MiB - 1 bytes, then nothing: the 401 comes without the body. A missing key is
    refused at once; an unknown one first by the key store (reading waits for its verdict), then by the
    cache."""
    cluster, key = await authed(make_cluster)
    headers: list[tuple[str, ...]] = [(), ("Authorization: Bearer kvg-not-a-key-at-all-0000",)] * 2
    for extra in headers:
        reply, client = await first_reply(
            cluster, post("/v1/chat/completions", b"", *extra, length=EIGHT_MIB - 1)
        )
        client.close()
        assert reply.status == 401, reply.body
        assert reply.json()["error"]["code"] in ("invalid_api_key", None)
        assert reply.headers.get("connection") == "close"
    # Expect: 100-continue: refused without the 100 (the client never sends the body).
    reply, client = await first_reply(
        cluster, post("/v1/chat/completions", b"", "Expect: 100-continue", length=EIGHT_MIB - 1)
    )
    client.close()
    assert reply.status == 401
    # A good key's request works as ever, the first time (looked up) and the next (cached), with a body
    # sent only after a pause, and with Expect: 100-continue.
    auth = f"Authorization: Bearer {key}"
    for _ in range(2):
        client = await Client.connect(cluster)
        await client.send(post("/v1/chat/completions", b"", auth, length=len(CHAT_BODY)))
        await asyncio.sleep(0.2)
        await client.send(CHAT_BODY)
        replies = await client.replies_until(1)
        client.close()
        assert replies[0].status == 200, replies[0].body
    client = await Client.connect(cluster)
    await client.send(post("/v1/chat/completions", b"", auth, "Expect: 100-continue", length=len(CHAT_BODY)))
    assert (await client.replies_until(1))[0].status == 100
    await client.send(CHAT_BODY)
    assert (await client.replies_until(2))[1].status == 200
    client.close()
    # aiohttp's requests are as before: /health needs no key, a completion over HTTP/1.0 is checked there.
    reply, client = await first_reply(cluster, get("/health"))
    client.close()
    assert reply.status == 200
    reply, client = await first_reply(cluster, post("/v1/chat/completions", CHAT_BODY, auth, version="1.0"))
    client.close()
    assert reply.status == 200
    reply, client = await first_reply(cluster, post("/v1/chat/completions", CHAT_BODY, version="1.0"))
    client.close()
    assert reply.status == 401


async def test_the_handler_gets_the_caller_lean_http_found(
    make_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key is looked up once, by lean_http, even when the whole request (two, pipelined) came in one
    write while the look-up was under way: the handler awaits that look-up instead of identifying again.
    aiohttp's requests are identified by their handler, as before. (Counted at the authenticator, which
    every identification asks: Billing may be a compiled class, whose methods cannot be wrapped.)"""
    cluster, key = await authed(make_cluster)
    authenticator = cluster.gateway.billing.authenticator
    checks: list[str] = []
    check: Callable[[str], Awaitable[Any]] = authenticator.check

    async def counted(key: str) -> Any:
        checks.append(key)
        return await check(key)

    monkeypatch.setattr(authenticator, "check", counted)
    auth = f"Authorization: Bearer {key}"
    pipelined = post("/v1/chat/completions", CHAT_BODY, auth)
    _, client = await first_reply(cluster, pipelined * 2)
    replies = await client.replies_until(2)
    client.close()
    assert [r.status for r in replies] == [200, 200]
    reply, client = await first_reply(cluster, pipelined)  # the key cached: known at once
    client.close()
    assert reply.status == 200
    assert checks == [key] * 3  # one look-up per request, lean_http's
    reply, client = await first_reply(cluster, post("/v1/chat/completions", CHAT_BODY, auth, version="1.0"))
    client.close()
    assert reply.status == 200 and checks == [key] * 4  # aiohttp's: its handler's


async def test_requests_refused_before_their_bodies_hold_no_memory(make_cluster: ClusterFactory) -> None:
    """40 unauthenticated connections, each sending the headers of an 8 MiB - 1 body, four of them 4 MiB of
    it too: answered 401 at once, and nothing of the bodies is kept (the lean connections hold no body
    bytes)."""
    cluster, _ = await authed(make_cluster)
    half = b"x" * (4 << 20)
    clients = []
    with contextlib.ExitStack() as stack:
        for _ in range(40):
            client = await Client.connect(cluster)
            stack.callback(client.close)
            clients.append(client)
            await client.send(post("/v1/chat/completions", b"", length=EIGHT_MIB - 1))
        for client in clients:
            assert (await client.replies_until(1))[0].status == 401
        for client in clients[:4]:
            with contextlib.suppress(ConnectionError):
                await client.send(half)
        await asyncio.sleep(0.2)
        # Neither the body nor the last read of it (nor the refusal's traceback, whose frames would hold it).
        held = [c for c in server(cluster).lean_connections if c._body or c._body_bytes]
        assert not held
        refusals = [c._refusal for c in server(cluster).lean_connections]
        assert len(refusals) == 40 and all(r and r[1].__traceback__ is None for r in refusals)


async def test_bodies_being_read_share_one_budget_even_with_good_keys(make_cluster: ClusterFactory) -> None:
    """Authenticated slow senders cannot hold the gateway's memory: past max_buffered_body_bytes (of bodies
    not yet whole, on all connections) a body gets 503 server_busy; bytes come back to the budget as bodies
    complete or their connections close."""
    cluster, key = await authed(make_cluster, edge={"max_buffered_body_bytes": 1 << 20})
    edge = server(cluster).edge
    assert edge is not None
    auth = f"Authorization: Bearer {key}"
    holders = []
    for _ in range(3):  # 3 x 400 KiB of 512 KiB bodies: the third passes 1 MiB
        client = await Client.connect(cluster)
        holders.append(client)
        await client.send(post("/v1/chat/completions", b"", auth, length=512 << 10) + b"x" * (400 << 10))
    reply = (await holders[2].replies_until(1))[0]
    assert reply.status == 503 and reply.json()["error"]["code"] == "server_busy"
    assert reply.headers["retry-after"] == "1" and reply.headers["retry-after-ms"] == "1000"
    await cluster.wait_for(lambda: edge.buffered == 800 << 10)
    assert cluster.gateway.metrics.connections_refused.labels("body_budget").value == 1
    for client in holders:
        client.close()
    await cluster.wait_for(lambda: edge.buffered == 0)
    client = await Client.connect(cluster)  # room again: a whole request goes through
    await client.send(post("/v1/chat/completions", CHAT_BODY, auth))
    assert (await client.replies_until(1))[0].status == 200
    assert edge.buffered == 0  # (a whole body is the request's, out of the budget)
    client.close()


async def test_a_body_sent_in_tiny_chunks_holds_about_its_own_size(make_cluster: ClusterFactory) -> None:
    """A chunked body of 2-byte chunks: what the connection holds of it while it is read is about its size
    (the body budget counts its bytes, so that is what they must cost). Kept as a piece per chunk, each
    2-byte piece cost some 45 bytes of memory: a client could hold 20 times the budget. The body is still
    whole when it ends: answered 200."""
    cluster = await gateway(make_cluster)
    padded = CHAT_BODY + b" " * ((512 << 10) + len(CHAT_BODY) % 2)  # (whitespace is valid JSON)
    chunked = b"".join(b"2\r\n%s\r\n" % padded[i : i + 2] for i in range(0, len(padded), 2))
    client = await Client.connect(cluster)
    await client.send(post("/v1/chat/completions", b"", "Transfer-Encoding: chunked").replace(
        b"Content-Length: 0\r\n", b"") + chunked)  # fmt: skip
    (connection,) = server(cluster).lean_connections
    await cluster.wait_for(lambda: connection._body_bytes == len(padded))
    held = sys.getsizeof(connection._body) + sum(sys.getsizeof(piece) for piece in connection._body)
    assert held < 2 * len(padded), held
    await client.send(b"0\r\n\r\n")
    replies = await client.replies_until(1)
    assert replies[0].status == 200, replies[0].body
    client.close()


async def test_a_client_that_reads_none_of_its_answers_is_cut_off_after_idle_timeout(
    make_cluster: ClusterFactory,
) -> None:
    """Answers wait for the client to read them (a pipelined burst must not buffer them all in the gateway's
    memory); a client that reads nothing for idle_timeout_s is closed, counted, and others are served."""
    cluster = await gateway(make_cluster, edge={"idle_timeout_s": 1.0})
    client = await Client.connect(cluster)
    client.writer.transport.set_write_buffer_limits(high=64 << 20)
    client.writer.write(get("/metrics") * 3000)  # hundreds of MB of answers, none of them read
    await cluster.wait_for(lambda: cluster.gateway.metrics.write_timeouts.labels().value == 1, within_s=10)
    await cluster.wait_for(lambda: limits(cluster).open == 0, within_s=5)
    await assert_served(cluster)
    client.close()
