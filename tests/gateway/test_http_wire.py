"""gateway.http.http_wire: a relayed whole answer framed by hand says what the same answer as an aiohttp
Response framed by ``whole_response`` says (status, headers, body), on a kept-alive connection, on a closing
one, and to an HTTP/1.0 client told that its connection is kept."""

from __future__ import annotations

import httptools
import pytest
from aiohttp import web

from gateway.http.http_wire import WholeAnswer, whole_response

HEADERS = {"x-request-id": "req-1", "x-kvgate-engine": "eu/e0", "x-kvgate-route": "prefix"}
BODY = b'{"id":"c1","usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'


class Parsed:
    def __init__(self, data: bytes) -> None:
        self.headers: dict[str, str] = {}
        self.body = b""
        self.done = self.keep_alive = False
        self.parser = httptools.HttpResponseParser(self)
        self.parser.feed_data(data)
        self.status = self.parser.get_status_code()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()  # (known while the message completes)


@pytest.mark.parametrize(("keep_alive", "announce"), [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("status", [200, 404])
def test_a_whole_answer_is_framed_as_its_aiohttp_response_would_be(
    keep_alive: bool, announce: bool, status: int
) -> None:
    answer = WholeAnswer(BODY, dict(HEADERS), status)
    response = web.Response(body=BODY, status=status, content_type="application/json", headers=HEADERS)
    ours = Parsed(answer.wire(keep_alive, announce_keep_alive=announce))
    theirs = Parsed(whole_response(response, keep_alive, announce_keep_alive=announce))
    assert ours.done and theirs.done
    assert (ours.status, ours.keep_alive, ours.body) == (theirs.status, theirs.keep_alive, theirs.body)
    assert (ours.status, ours.keep_alive, ours.body) == (status, keep_alive, BODY)
    assert ours.headers.keys() == theirs.headers.keys()
    assert {k: v for k, v in ours.headers.items() if k != "date"} == {
        k: v for k, v in theirs.headers.items() if k != "date"
    }
    assert ours.headers["content-type"] == "application/json"
    assert ours.headers.get("connection") == (
        "close" if not keep_alive else "keep-alive" if announce else None
    )
    assert int(ours.headers["content-length"]) == len(BODY)


def test_whole_response_passes_a_whole_answer_through() -> None:
    answer = WholeAnswer(BODY, dict(HEADERS))
    assert whole_response(answer, True) == answer.wire(True)
