"""What the lean server refuses in a request's head once its headers are in, before any of its body is
read: the checks of one pass over the headers (``head_refusal``), and ``bad_http``, the error of a request
that cannot be taken as HTTP."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.http.errors import GatewayError, InvalidRequest, PayloadTooLarge

HTTP_1_0_OR_OLDER = frozenset({"0.9", "1.0"})  # httptools' versions of clients that take no 1xx


def bad_http(status: int, message: str) -> GatewayError:
    """An OpenAI-shaped error for a request this server cannot take as HTTP (code ``bad_http_request``)."""
    error = InvalidRequest(message, code="bad_http_request")
    error.status = status
    return error


def head_refusal(
    headers: Sequence[tuple[str, str]], version: str, max_body: int
) -> tuple[GatewayError | None, str | None]:
    """(the refusal of a request with these headers, or None; its ``Expect`` to answer with a 100, or None),
    in one pass over the headers. Host and Transfer-Encoding lines are counted and joined: a second line
    must not hide what the first said (httptools reads the framing off them all)."""
    hosts = 0
    expect = length = None
    codings: list[str] = []
    for name, value in headers:
        key = name.lower()
        if key == "host":
            hosts += 1
        elif key == "content-length":
            length = value  # (httptools refuses a second one)
        elif key == "expect":
            expect = value
        elif key == "transfer-encoding":
            codings.append(value)
    if hosts != 1 and version == "1.1":  # RFC 9112 3.2: a server MUST refuse none, or several
        return bad_http(400, "an HTTP/1.1 request must have one Host header"), expect
    coding = ", ".join(codings)
    if codings and [c.strip().lower() for c in coding.split(",")] != ["chunked"]:
        # httptools undoes chunked alone: another transfer coding (gzip, chunked) would reach the handler
        # still applied. RFC 9112 6.1 (and nginx): 501.
        message = f"Transfer-Encoding {coding[:40]!r} is not supported: send the body chunked or with a "
        return bad_http(501, message + "Content-Length (compressed: Content-Encoding)"), expect
    if expect is not None and expect.lower() != "100-continue":
        return bad_http(417, f"unsupported Expect: {expect[:40]!r} (only 100-continue is)"), expect
    if version in HTTP_1_0_OR_OLDER:
        # RFC 9110 10.1.1 and 15.2: ignored, and no 1xx sent: an HTTP/1.0 client has no interim responses
        # and would take the 100 for its answer.
        expect = None
    if length is not None and length.isdigit() and int(length) > max_body:
        return PayloadTooLarge(f"request body of {length} bytes exceeds the {max_body}-byte limit"), expect
    return None, expect
