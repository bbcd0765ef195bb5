"""gateway.http.lean_http at the socket: the gateway's one HTTP server, every endpoint and every way a
request can come (keep-alive, pipelining, HTTP/1.0, HEAD, Upgrade, absolute and escaped targets), and how
it fails (404, 405, 414, 417, 431, malformed requests).

The rest of the suite reaches every endpoint through it too (the harness runs the gateway's own runner);
these tests speak raw HTTP to reach the cases clients rarely produce.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from cache.ledger import MemoryLedger
from tests.harness import MODEL, Cluster, start_cluster
from tests.raw_http import Replies, Reply

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MAX_BODY = 64 * 1024


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.replies = Replies()
        self.closed = False

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def replies_until(self, count: int, within_s: float = 10.0) -> list[Reply]:
        async with asyncio.timeout(within_s):
            while len(self.replies.done) < count:
                data = await self.reader.read(65536)
                if not data:
                    self.closed = True
                    break
                self.replies.feed(data)
        return self.replies.done

    async def is_closed_by_server(self, within_s: float = 5.0) -> bool:
        async with asyncio.timeout(within_s):
            while True:
                data = await self.reader.read(65536)
                if not data:
                    return True
                self.replies.feed(data)

    def close(self) -> None:
        self.writer.close()


def post(path: str, body: bytes, *headers: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: test", "Content-Type: application/json", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def get(path: str, *headers: str, method: str = "GET", version: str = "1.1") -> bytes:
    return ("\r\n".join([f"{method} {path} HTTP/{version}", "Host: test", *headers]) + "\r\n\r\n").encode()


CHAT_REQUEST = post("/v1/chat/completions", json.dumps(CHAT).encode())


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = await start_cluster(regions={"eu-west": 2}, max_body_bytes=MAX_BODY)
    yield c
    await c.close()


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[Client]:
    host, port = cluster.url.removeprefix("http://").split(":")
    c = Client(*await asyncio.open_connection(host, int(port)))
    yield c
    c.close()


def lean_connections(cluster: Cluster) -> int:
    runner = cluster._runners[-1]  # the gateway's
    return len(runner.server.lean_connections)  # type: ignore[union-attr]


async def test_keep_alive_across_completions_and_every_other_endpoint(
    cluster: Cluster, client: Client
) -> None:
    await client.send(CHAT_REQUEST)
    await client.send(CHAT_REQUEST)
    await client.replies_until(1)
    await client.send(CHAT_REQUEST)  # the same connection, kept alive
    replies = await client.replies_until(3)
    assert [r.status for r in replies] == [200, 200, 200]
    assert all(r.json()["object"] == "chat.completion" for r in replies)
    assert replies[0].headers["content-length"] == str(len(replies[0].body))
    assert "x-kvgate-engine" in replies[0].headers and "date" in replies[0].headers
    for path, check in [
        ("/health", lambda r: r.json()["engines_total"] == 2),
        ("/v1/models", lambda r: r.json()["object"] == "list"),
        ("/metrics", lambda r: b"kvgate_requests_total" in r.body),
        ("/dashboard", lambda r: r.headers["content-type"].startswith("text/html")),
        ("/v1/usage", lambda r: r.json()["object"] == "usage"),
    ]:
        await client.send(get(path))
        replies = await client.replies_until(len(client.replies.done) + 1)
        assert replies[-1].status == 200 and check(replies[-1]), (path, replies[-1].body[:200])
        assert replies[-1].headers["content-length"] == str(len(replies[-1].body))
    await client.send(CHAT_REQUEST)
    replies = await client.replies_until(9)
    assert replies[8].status == 200 and replies[8].json()["object"] == "chat.completion"
    assert lean_connections(cluster) == 1 and not client.closed  # one connection throughout


async def test_pipelined_completions_are_answered_in_order(client: Client) -> None:
    bodies = [{**CHAT, "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(4)]
    await client.send(b"".join(post("/v1/chat/completions", json.dumps(b).encode()) for b in bodies))
    replies = await client.replies_until(4)
    assert [r.status for r in replies] == [200] * 4
    # Prompts of different lengths: each answer's usage is its own request's.
    prompt_tokens = [r.json()["usage"]["prompt_tokens"] for r in replies]
    assert prompt_tokens == sorted(prompt_tokens) or len(set(prompt_tokens)) == 1
    ids = [r.headers["x-request-id"] for r in replies]
    assert len(set(ids)) == 4


async def test_requests_of_every_kind_pipelined_in_one_read_are_all_answered_in_order(
    client: Client,
) -> None:
    await client.send(CHAT_REQUEST + get("/health") + get("/nowhere") + CHAT_REQUEST + get("/v1/models"))
    replies = await client.replies_until(5)
    assert [r.status for r in replies] == [200, 200, 404, 200, 200]
    assert replies[0].json()["object"] == replies[3].json()["object"] == "chat.completion"
    assert replies[1].json()["engines_total"] == 2 and replies[4].json()["object"] == "list"
    assert replies[2].json()["error"]["code"] == "not_found"
    assert not client.closed


async def test_a_malformed_request_behind_good_ones_gets_its_400_after_them_then_the_connection_closes(
    client: Client,
) -> None:
    await client.send(CHAT_REQUEST + get("/health") + b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n")
    replies = await client.replies_until(3)
    assert [r.status for r in replies] == [200, 200, 400]
    error = replies[2].json()["error"]
    assert error["code"] == "bad_http_request" and error["message"].startswith("malformed HTTP request")
    assert replies[2].headers.get("connection") == "close"
    assert await client.is_closed_by_server()


async def test_a_request_split_into_many_small_writes(client: Client) -> None:
    raw = post("/v1/chat/completions?trace=1", json.dumps(CHAT).encode())
    for i in range(0, len(raw), 7):
        await client.send(raw[i : i + 7])
        await asyncio.sleep(0)
    replies = await client.replies_until(1)
    assert replies[0].status == 200 and replies[0].json()["object"] == "chat.completion"


async def test_chunked_request_body(client: Client) -> None:
    body = json.dumps(CHAT).encode()
    chunked = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 10]), body[i : i + 10]) for i in range(0, len(body), 10)
    )
    await client.send(post("/v1/chat/completions", chunked + b"0\r\n\r\n", "Transfer-Encoding: chunked"))
    replies = await client.replies_until(1)
    assert replies[0].status == 200, replies[0].body


async def test_expect_100_continue(client: Client) -> None:
    body = json.dumps(CHAT).encode()
    head = post("/v1/chat/completions", b"", f"Content-Length: {len(body)}", "Expect: 100-continue")
    await client.send(head)
    replies = await client.replies_until(1)
    assert replies[0].status == 100
    await client.send(body)
    replies = await client.replies_until(2)
    assert replies[1].status == 200


async def test_an_http_1_0_client_gets_no_100_continue(client: Client) -> None:
    """RFC 9110 10.1.1 and 15.2: a server MUST ignore a 100-continue expectation in an HTTP/1.0 request and
    MUST NOT send a 1xx to an HTTP/1.0 client, which has no interim responses: it would take the 100 for
    the answer and the real one for garbage. The first response is the 200, and the only one."""
    body = json.dumps(CHAT).encode()
    await client.send(post("/v1/chat/completions", body, "Expect: 100-continue", version="1.0"))
    assert await client.is_closed_by_server()  # (HTTP/1.0 without keep-alive: everything is in)
    assert [r.status for r in client.replies.done] == [200]
    assert client.replies.done[0].json()["object"] == "chat.completion"


async def test_expect_100_continue_behind_a_stream_gets_its_100_once_the_stream_is_answered(
    client: Client,
) -> None:
    """A request with ``Expect: 100-continue`` whose head comes while the answer before it streams: its 100
    comes after that answer (not before, inside it), and its body is then read and answered. The client
    waits for the 100 (RFC 9110 10.1.1 lets it), so the server must send one: it got none, and a 408 at the
    body deadline."""
    stream = {**CHAT, "stream": True, "max_tokens": 400}  # 0.2 s of decoding
    body = json.dumps(CHAT).encode()
    head = post("/v1/chat/completions", b"", f"Content-Length: {len(body)}", "Expect: 100-continue")
    await client.send(post("/v1/chat/completions", json.dumps(stream).encode()) + head)
    replies = await client.replies_until(2)
    assert replies[0].status == 200 and replies[0].body.endswith(b"data: [DONE]\n\n")
    assert replies[1].status == 100
    await client.send(body)
    replies = await client.replies_until(3)
    assert replies[2].status == 200 and replies[2].json()["object"] == "chat.completion"
    assert not client.closed


async def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(client: Client) -> None:
    size = MAX_BODY + 1
    await client.send(post("/v1/chat/completions", b"", f"Content-Length: {size}", "Expect: 100-continue"))
    replies = await client.replies_until(1)
    assert replies[0].status == 413
    error = replies[0].json()["error"]
    assert error["code"] == "request_too_large" and str(size) in error["message"]
    assert replies[0].headers.get("connection") == "close"


async def test_a_body_over_the_limit_sent_in_full_still_gets_its_413(client: Client) -> None:
    """The body is read and dropped before the connection closes: a close with unread bytes would reset
    the connection and the client would never see the answer."""
    body = b'{"model": "' + b"x" * (3 * MAX_BODY) + b'"}'
    await client.send(post("/v1/chat/completions", body))
    replies = await client.replies_until(1)
    assert replies[0].status == 413
    assert await client.is_closed_by_server()


async def connect(cluster: Cluster) -> Client:
    host, port = cluster.url.removeprefix("http://").split(":")
    return Client(*await asyncio.open_connection(host, int(port)))


async def test_http_1_0_closes_unless_kept_alive_and_gets_its_stream_unframed(cluster: Cluster) -> None:
    body = json.dumps(CHAT).encode()
    client = await connect(cluster)
    try:  # HTTP/1.0 without keep-alive: the answer, then the connection closes
        await client.send(post("/v1/chat/completions", body, version="1.0"))
        replies = await client.replies_until(1)
        assert replies[0].status == 200 and replies[0].json()["object"] == "chat.completion"
        assert replies[0].headers.get("connection") == "close"
        assert await client.is_closed_by_server()
    finally:
        client.close()
    client = await connect(cluster)
    try:  # Connection: keep-alive: it is said back, and the connection serves the next request
        await client.send(post("/v1/chat/completions", body, "Connection: keep-alive", version="1.0"))
        await client.send(get("/health", "Connection: keep-alive", version="1.0"))
        replies = await client.replies_until(2)
        assert [r.status for r in replies] == [200, 200]
        assert [r.headers.get("connection") for r in replies] == ["keep-alive", "keep-alive"]
        assert not client.closed
    finally:
        client.close()
    client = await connect(cluster)
    try:  # a stream to HTTP/1.0: no chunked encoding (a 1.0 client cannot read it); the close ends it
        stream = {**CHAT, "stream": True, "max_tokens": 3}
        await client.send(post("/v1/chat/completions", json.dumps(stream).encode(), version="1.0"))
        raw = b""
        async with asyncio.timeout(10):
            while data := await client.reader.read(65536):
                raw += data
        head, _, streamed = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower()
        assert b"connection: close" in head.lower()
        assert streamed.startswith(b"data: {") and streamed.endswith(b"data: [DONE]\n\n")
    finally:
        client.close()


async def test_an_http_1_0_request_with_transfer_encoding_is_answered_then_the_connection_closes(
    client: Client,
) -> None:
    """RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing (an HTTP/1.0 hop before
    the gateway would not have read it as chunked): answered, then the connection closes, whatever its
    Connection header said. The GET pipelined behind it is not read."""
    body = json.dumps(CHAT).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    framed = post("/v1/chat/completions", chunked, "Transfer-Encoding: chunked", "Connection: keep-alive",
                  version="1.0")  # fmt: skip
    await client.send(framed + get("/health", "Connection: keep-alive", version="1.0"))
    replies = await client.replies_until(1)
    assert replies[0].status == 200 and replies[0].json()["object"] == "chat.completion"
    assert replies[0].headers.get("connection") == "close"
    assert await client.is_closed_by_server()
    assert len(client.replies.done) == 1


async def test_unknown_paths_get_404_and_wrong_methods_405_with_allow(client: Client) -> None:
    await client.send(get("/v1/chat/completions"))
    await client.send(post("/v1/models", b"{}"))
    await client.send(get("/v1/nothing-here"))
    await client.send(get("/health", method="DELETE"))
    replies = await client.replies_until(4)
    assert [r.status for r in replies] == [405, 405, 404, 405]
    assert replies[0].headers["allow"] == "POST"
    assert replies[1].headers["allow"] == replies[3].headers["allow"] == "GET, HEAD"
    assert replies[0].json()["error"]["code"] == "method_not_allowed"
    assert replies[2].json()["error"] == {
        "message": "no such endpoint", "type": "invalid_request_error", "param": None, "code": "not_found"
    }  # fmt: skip
    assert not client.closed  # (errors of the request, not of the connection)


async def test_head_gets_the_get_answers_head_alone(client: Client) -> None:
    await client.send(get("/health"))
    whole = (await client.replies_until(1))[0]
    raw = b""
    await client.send(get("/health", method="HEAD") + get("/v1/models"))
    async with asyncio.timeout(10):
        while raw.count(b"\r\n\r\n") < 2 or not raw.endswith(b"}"):
            raw += await client.reader.read(65536)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert f"content-length: {len(whole.body)}".encode() in head.lower()  # the GET's length, no body
    assert rest.startswith(b"HTTP/1.1 200")  # the next answer follows the head at once


async def test_escaped_and_absolute_targets_reach_their_routes(client: Client) -> None:
    await client.send(get("/v1/mod%65ls") + get("http://gateway.example/health?x=1") + get("/health#frag"))
    replies = await client.replies_until(3)
    assert [r.status for r in replies] == [200, 200, 200]
    assert replies[0].json()["object"] == "list" and replies[1].json()["engines_total"] == 2


async def test_an_upgrade_is_not_taken_the_request_is_answered_and_http_1_1_goes_on(client: Client) -> None:
    """curl --http2 on http:// asks for h2c with its POST; websocket clients ask on a GET. httptools stops at
    an Upgrade's headers and leaves its body unread: the body is read all the same (split over reads here),
    the request answered as HTTP/1.1, and the connection serves the next request."""
    body = json.dumps(CHAT).encode()
    h2c = post("/v1/chat/completions", body, "Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
               "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA")  # fmt: skip
    await client.send(h2c[:-10])
    await asyncio.sleep(0.05)
    await client.send(h2c[-10:] + get("/health", "Connection: Upgrade", "Upgrade: websocket") + CHAT_REQUEST)
    replies = await client.replies_until(3)
    assert [r.status for r in replies] == [200, 200, 200]
    assert replies[0].json()["object"] == replies[2].json()["object"] == "chat.completion"
    assert replies[1].json()["engines_total"] == 2
    assert not client.closed


async def test_an_upgrade_with_a_chunked_body_is_refused(client: Client) -> None:
    await client.send(post("/v1/completions", b"2\r\n{}\r\n0\r\n\r\n", "Connection: Upgrade", "Upgrade: h2c",
                           "Transfer-Encoding: chunked"))  # fmt: skip
    replies = await client.replies_until(1)
    assert replies[0].status == 400 and "Upgrade" in replies[0].json()["error"]["message"]
    assert await client.is_closed_by_server()


async def test_an_upgrade_with_a_body_over_the_limit_gets_its_413_not_a_reset(client: Client) -> None:
    """curl --http2 asks for h2c on a POST too. Its body over the limit was left unread (httptools leaves an
    Upgrade's body to the server), parsed as a request, found malformed, and the connection closed with the
    rest unread: a reset, in which the client may lose its 413. It is read and dropped, as any refused
    body is, and the connection closes once it is in."""
    body = b'{"model": "' + b"x" * (32 * MAX_BODY) + b'"}'
    await client.send(post("/v1/chat/completions", body, "Connection: Upgrade", "Upgrade: h2c"))
    replies = await client.replies_until(1)
    assert replies[0].status == 413 and replies[0].json()["error"]["code"] == "request_too_large"
    assert await client.is_closed_by_server()  # (a reset raises ConnectionResetError)
    assert len(client.replies.done) == 1


BOTH_FRAMINGS = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (get("/" + "a" * 9000), 414),
        (get("/health", *(f"x-h{i}: v" for i in range(200))), 431),
        (get("/health", "x-big: " + "v" * 9000), 431),
        (post("/v1/chat/completions", b"{}", "Expect: something-else"), 417),
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (BOTH_FRAMINGS, 400),  # (a request smuggling vector)
    ],
    ids=["long-target", "many-headers", "long-header", "expect", "garbage", "length-and-chunked"],
)
async def test_requests_that_cannot_be_taken_get_a_json_error_and_the_connection_closes(
    client: Client, request_bytes: bytes, status: int
) -> None:
    await client.send(request_bytes)
    replies = await client.replies_until(1)
    assert replies[0].status == status
    error = replies[0].json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "bad_http_request"
    assert "vvvv" not in error["message"]  # a header is never echoed: it may be a credential
    assert await client.is_closed_by_server()


async def send_forever(client: Client) -> list[Reply]:
    """Send 512 KiB of one field's value, 8 KiB at a time (or until the server closes), then the reply."""
    with contextlib.suppress(ConnectionError):
        for _ in range(64):
            await client.send(b"v" * 8192)
            await asyncio.sleep(0)
    return await client.replies_until(1)


async def test_a_head_that_never_ends_is_refused_not_buffered(client: Client) -> None:
    """httptools keeps a header until it ends: a client sending one forever is cut off once 64 KiB of it
    have come after the read it began in (a read is at most 256 KiB)."""
    await client.send(b"GET /health HTTP/1.1\r\nx-endless: ")
    replies = await send_forever(client)
    assert replies[0].status == 431
    assert await client.is_closed_by_server()


def chunked_chat(trailer: bytes) -> bytes:
    body = json.dumps(CHAT).encode()
    framed = b"%x\r\n%s\r\n0\r\n%s" % (len(body), body, trailer)
    return post("/v1/chat/completions", framed, "Transfer-Encoding: chunked")


async def test_trailer_fields_are_not_taken_for_headers(client: Client) -> None:
    """RFC 9110 6.5.1: a chunked body's trailer fields are not merged into the header section. They were:
    a trailer's Content-Encoding got the request a 415, its x-request-id named the answer."""
    await client.send(chunked_chat(b"Content-Encoding: br\r\nx-request-id: from-the-trailer\r\n\r\n"))
    replies = await client.replies_until(1)
    assert replies[0].status == 200, replies[0].body
    assert replies[0].headers["x-request-id"] != "from-the-trailer"
    await client.send(chunked_chat(b"\r\n"))  # the connection goes on
    assert (await client.replies_until(2))[1].status == 200


async def test_a_trailer_that_never_ends_is_refused_not_buffered(client: Client) -> None:
    """As a head that never ends: httptools keeps a trailer field until it ends (copying it at every read),
    so one sent forever held memory and the event loop until the body deadline. Refused past 64 KiB."""
    await client.send(chunked_chat(b"x-endless: "))
    replies = await send_forever(client)
    assert replies[0].status == 431
    assert replies[0].json()["error"]["code"] == "bad_http_request"
    assert await client.is_closed_by_server()


async def test_a_streamed_answer_is_chunked_and_the_connection_stays_usable(client: Client) -> None:
    stream = {**CHAT, "stream": True, "max_tokens": 5, "stream_options": {"include_usage": True}}
    await client.send(post("/v1/chat/completions", json.dumps(stream).encode()))
    replies = await client.replies_until(1)
    reply = replies[0]
    assert reply.status == 200
    assert reply.headers["transfer-encoding"] == "chunked"
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [e for e in reply.body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 5
    await client.send(CHAT_REQUEST)
    replies = await client.replies_until(2)
    assert replies[1].status == 200


async def test_a_stream_to_a_client_that_asked_to_close_says_it_closes(client: Client) -> None:
    # RFC 9112 9.6: the answer to a request with "Connection: close" says so, streamed ones too; then the
    # connection closes after the stream's last chunk.
    stream = {**CHAT, "stream": True, "max_tokens": 3}
    await client.send(post("/v1/chat/completions", json.dumps(stream).encode(), "Connection: close"))
    replies = await client.replies_until(1)
    assert replies[0].status == 200 and replies[0].headers["transfer-encoding"] == "chunked"
    assert replies[0].headers.get("connection") == "close"
    assert replies[0].body.decode().endswith("data: [DONE]\n\n")
    assert await client.is_closed_by_server()


async def test_a_client_that_leaves_mid_stream_aborts_the_engine_and_is_billed(cluster: Cluster) -> None:
    host, port = cluster.url.removeprefix("http://").split(":")
    client = Client(*await asyncio.open_connection(host, int(port)))
    stream = {**CHAT, "stream": True, "max_tokens": 20_000}  # 10 s of decoding
    await client.send(post("/v1/chat/completions", json.dumps(stream).encode()))
    first = await client.reader.read(4096)
    assert b"200 OK" in first
    client.writer.transport.abort()  # gone, mid-stream
    ledger = cluster.gateway.billing.ledger
    assert isinstance(ledger, MemoryLedger)
    await cluster.wait_for(lambda: len(ledger) > 0, within_s=10)
    assert [r.status for r in await ledger.records()] == ["aborted"]
    sims = [cluster.sim(e) for e in cluster.engines]
    await cluster.wait_for(lambda: not any(s.running for s in sims), within_s=5)  # stopped, not finished


async def test_shutdown_lets_an_answer_in_progress_finish(cluster: Cluster) -> None:
    host, port = cluster.url.removeprefix("http://").split(":")
    client = Client(*await asyncio.open_connection(host, int(port)))
    stream = {**CHAT, "stream": True, "max_tokens": 40}  # 20 ms of decoding
    await client.send(post("/v1/chat/completions", json.dumps(stream).encode()))
    await asyncio.sleep(0.005)
    runner = cluster._runners.pop()  # the gateway's, cleaned up here
    await runner.cleanup()
    replies = await client.replies_until(1)
    assert replies[0].status == 200
    assert replies[0].body.endswith(b"data: [DONE]\n\n")
    assert await client.is_closed_by_server()


async def test_lean_http_false_in_an_old_config_still_starts_and_is_served_the_one_way() -> None:
    cluster = await start_cluster(regions={"eu-west": 1}, lean_http=False)
    try:
        status, body, _ = await cluster.post("/v1/chat/completions", CHAT)
        assert status == 200 and body["object"] == "chat.completion"
        assert lean_connections(cluster) == 1  # (the harness's client keeps its connection)
    finally:
        await cluster.close()


async def test_a_get_split_over_many_reads(cluster: Cluster, client: Client) -> None:
    raw = get("/health")
    for i in range(0, len(raw), 3):
        await client.send(raw[i : i + 3])
        await asyncio.sleep(0.001)
    replies = await client.replies_until(1)
    assert replies[0].status == 200 and replies[0].json()["engines_total"] == 2


async def test_a_get_sent_while_a_completion_runs_waits_for_it(client: Client) -> None:
    slow = {**CHAT, "max_tokens": 40}  # 20 ms of decoding
    await client.send(post("/v1/chat/completions", json.dumps(slow).encode()))
    await asyncio.sleep(0.005)
    await client.send(get("/v1/models"))
    replies = await client.replies_until(2)
    assert replies[0].status == 200 and replies[0].json()["usage"]["completion_tokens"] == 40
    assert replies[1].status == 200 and replies[1].json()["object"] == "list"


async def test_a_burst_of_pipelined_requests_is_parsed_as_fast_as_it_is_answered(
    cluster: Cluster, client: Client
) -> None:
    """Requests without bodies cost nothing to send: 5,000 GET /metrics pipelined in one burst (150 kB)
    must become neither their answers (hundreds of MB) buffered for a client that does not read them nor
    5,000 queued requests. Answers wait for the client to read, requests are parsed only as the queue
    drains, and every one is answered, in order."""
    count = 5_000
    send = asyncio.ensure_future(client.send(get("/metrics") * count))
    await asyncio.sleep(1.0)  # the client reads nothing meanwhile: the answers back up
    (connection,) = cluster._runners[-1].server.lean_connections  # type: ignore[union-attr]
    assert connection.transport.get_write_buffer_size() < 1 << 20  # answers wait for the client to read
    assert len(connection._queue) <= 1000  # and requests are parsed ahead of them by a slice of the burst
    replies = await client.replies_until(count, within_s=120)
    await send
    assert len(replies) == count and {r.status for r in replies} == {200}
    assert not client.closed
