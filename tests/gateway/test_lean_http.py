"""gateway.http.lean_http at the socket: what it serves itself, what it hands to aiohttp, and how it fails.

The rest of the suite reaches the completion endpoints through it too (the harness runs the gateway's own
runner); these tests speak raw HTTP/1.1 to reach the cases clients rarely produce.
"""

from __future__ import annotations

import asyncio
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


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode()


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


async def test_keep_alive_then_a_hand_off_to_aiohttp_then_more_completions(
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
    assert lean_connections(cluster) == 1
    await client.send(get("/health"))  # aiohttp's from here on
    replies = await client.replies_until(4)
    assert replies[3].status == 200 and replies[3].json()["engines_total"] == 2
    assert lean_connections(cluster) == 0
    await client.send(CHAT_REQUEST)
    replies = await client.replies_until(5)
    assert replies[4].status == 200 and replies[4].json()["object"] == "chat.completion"


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


async def test_a_request_pipelined_behind_a_completion_in_one_read_is_refused_not_lost(
    client: Client,
) -> None:
    """It began in the middle of a read, so its bytes cannot go to aiohttp: a 400 that says why, and the
    connection closes after the completion before it has been answered."""
    await client.send(CHAT_REQUEST + get("/health"))
    replies = await client.replies_until(2)
    assert replies[0].status == 200 and replies[0].json()["object"] == "chat.completion"
    assert replies[1].status == 400
    assert "pipelined" in replies[1].json()["error"]["message"]
    assert replies[1].headers.get("connection") == "close"
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


async def test_http_1_0_and_other_methods_go_to_aiohttp(cluster: Cluster, client: Client) -> None:
    await client.send(post("/v1/chat/completions", json.dumps(CHAT).encode(), version="1.0"))
    replies = await client.replies_until(1)
    assert replies[0].status == 200 and replies[0].json()["object"] == "chat.completion"
    host, port = cluster.url.removeprefix("http://").split(":")
    other = Client(*await asyncio.open_connection(host, int(port)))
    try:
        await other.send(get("/v1/chat/completions"))
        replies = await other.replies_until(1)
        assert replies[0].status == 405
        assert "error" in replies[0].json()
    finally:
        other.close()


async def test_garbage_on_a_new_connection_gets_aiohttps_json_400(client: Client) -> None:
    await client.send(b"NOT HTTP AT ALL\r\n\r\n")
    replies = await client.replies_until(1)
    assert replies[0].status == 400
    assert replies[0].json()["error"]["code"] == "bad_http_request"


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


async def test_lean_http_off_serves_everything_with_aiohttp() -> None:
    cluster = await start_cluster(regions={"eu-west": 1}, lean_http=False)
    try:
        status, body, _ = await cluster.post("/v1/chat/completions", CHAT)
        assert status == 200 and body["object"] == "chat.completion"
        assert lean_connections(cluster) == 0
        assert not cluster._runners[-1].server.lean  # type: ignore[union-attr]
    finally:
        await cluster.close()


async def test_a_request_for_aiohttp_split_over_many_reads_is_handed_over_whole(
    cluster: Cluster, client: Client
) -> None:
    raw = get("/health")
    for i in range(0, len(raw), 3):
        await client.send(raw[i : i + 3])
        await asyncio.sleep(0.001)
    replies = await client.replies_until(1)
    assert replies[0].status == 200 and replies[0].json()["engines_total"] == 2
    assert lean_connections(cluster) == 0


async def test_a_request_for_aiohttp_sent_while_a_completion_runs_waits_for_it(client: Client) -> None:
    slow = {**CHAT, "max_tokens": 40}  # 20 ms of decoding
    await client.send(post("/v1/chat/completions", json.dumps(slow).encode()))
    await asyncio.sleep(0.005)  # its own read: it can be handed over, once the completion is answered
    await client.send(get("/v1/models"))
    replies = await client.replies_until(2)
    assert replies[0].status == 200 and replies[0].json()["usage"]["completion_tokens"] == 40
    assert replies[1].status == 200 and replies[1].json()["object"] == "list"
