"""Compressed request bodies: gzip and deflate decoded within the body limit, other codings refused with 415;
and HTTP/1.1 requests without a Host header refused."""

from __future__ import annotations

import gzip
import json
import socket
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.http.content_coding import ACCEPTED, UnsupportedEncoding, decode_body
from gateway.http.errors import InvalidRequest, PayloadTooLarge
from tests.gateway.test_bad_input import GOOD, BackgroundCluster, assert_openai_error

LIMIT = 64 * 1024
BODY = json.dumps(GOOD).encode()


@pytest.fixture(scope="module")
def gw() -> Iterator[BackgroundCluster]:
    cluster = BackgroundCluster(regions={"eu-west": 1}, max_body_bytes=LIMIT)
    yield cluster
    cluster.close()


def send(gw: BackgroundCluster, body: bytes, coding: str) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json", "Content-Encoding": coding}
    return gw.request("POST", "/v1/chat/completions", body, headers)


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    ("coding", "encode"),
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("deflate", zlib.compress),  # the zlib format, as RFC 9110 names it
        ("deflate", raw_deflate),  # bare deflate, as some clients send
        ("identity", lambda b: b),
        ("gzip, gzip", lambda b: gzip.compress(gzip.compress(b))),
    ],
)
def test_compressed_bodies_are_answered_as_plain_ones(
    gw: BackgroundCluster, coding: str, encode: object
) -> None:
    assert callable(encode)
    status, _, plain = gw.request("POST", "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
    assert status == 200
    status, _, data = send(gw, encode(BODY), coding)
    assert status == 200, data[:300]
    assert json.loads(data)["usage"]["prompt_tokens"] == json.loads(plain)["usage"]["prompt_tokens"]


def test_an_unknown_coding_is_415_with_the_codings_taken(gw: BackgroundCluster) -> None:
    status, headers, data = send(gw, BODY, "br")
    error = assert_openai_error(status, data, 415)
    assert error["code"] == "unsupported_content_encoding" and "'br'" in error["message"]
    assert headers["Accept-Encoding"] == ACCEPTED


def test_a_small_bomb_is_refused_at_the_body_limit(gw: BackgroundCluster) -> None:
    bomb = gzip.compress(b" " * (50 * LIMIT))  # 3.2 MB of spaces in a few kilobytes
    assert len(bomb) < LIMIT // 4
    status, _, data = send(gw, bomb, "gzip")
    assert assert_openai_error(status, data, 413)["code"] == "request_too_large"
    status, _, _ = gw.request("POST", "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
    assert status == 200  # and the gateway serves on


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (BODY, "not valid gzip"),  # sent plain, labelled gzip
        (gzip.compress(BODY)[:-12], "cut short"),
        (gzip.compress(BODY) + b"junk!", "not valid gzip"),  # (read as a second member)
    ],
    ids=["plain", "cut-short", "trailing-junk"],  # (gzip's header holds the time: ids must not)
)
def test_bodies_that_are_not_what_their_coding_says_are_400(
    gw: BackgroundCluster, body: bytes, said: str
) -> None:
    status, _, data = send(gw, body, "gzip")
    assert said in assert_openai_error(status, data, 400)["message"]


def test_decode_body_bounds_and_members() -> None:
    two_members = gzip.compress(b'{"a":') + gzip.compress(b"1}")
    assert decode_body(two_members, "gzip", 100) == b'{"a":1}'
    assert decode_body(gzip.compress(b"x" * 100), "gzip", 100) == b"x" * 100
    with pytest.raises(PayloadTooLarge):
        decode_body(gzip.compress(b"x" * 101), "gzip", 100)
    with pytest.raises(PayloadTooLarge):  # the limit counts every member together
        decode_body(gzip.compress(b"x" * 60) + gzip.compress(b"x" * 60), "gzip", 100)
    with pytest.raises(UnsupportedEncoding):
        decode_body(b"{}", "gzip, zstd", 100)  # (the last coding applied is undone first)
    with pytest.raises(InvalidRequest, match="after the end"):
        decode_body(zlib.compress(b"{}") + b"x", "deflate", 100)


def test_an_http11_request_without_host_is_400(gw: BackgroundCluster) -> None:
    with socket.create_connection((gw.host, gw.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert "Host" in assert_openai_error(400, body)["message"]
    with socket.create_connection((gw.host, gw.port), timeout=10) as sock:  # HTTP/1.0 needs none
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def exchange(gw: BackgroundCluster, request: bytes) -> tuple[bytes, dict[str, Any]]:
    """One request on its own connection, read until the gateway closes it: (status line, error)."""
    with socket.create_connection((gw.host, gw.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    status_line, _, rest = answer.partition(b"\r\n")
    return status_line, json.loads(rest.partition(b"\r\n\r\n")[2])["error"]


@pytest.mark.parametrize(
    ("lines", "shown"),
    [
        (b"Transfer-Encoding: gzip, chunked", "gzip, chunked"),
        (b"Transfer-Encoding: deflate,chunked", "deflate,chunked"),
        (b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked", "gzip, chunked"),  # the same on two lines
    ],
)
def test_a_transfer_coding_other_than_chunked_is_501(gw: BackgroundCluster, lines: bytes, shown: str) -> None:
    # httptools takes the framing (chunked, last) and leaves the gzip applied: the body was read as if plain.
    chunk = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    status, error = exchange(
        gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n%s\r\n\r\n" % lines + chunk
    )
    assert status == b"HTTP/1.1 501 Not Implemented"
    assert error["code"] == "bad_http_request" and repr(shown) in error["message"]


def test_an_http11_request_with_two_hosts_is_400(gw: BackgroundCluster) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\nContent-Length: %d\r\n\r\n"
    status, error = exchange(gw, head % len(BODY) + BODY)
    assert status.startswith(b"HTTP/1.1 400 ") and "one Host" in error["message"]
