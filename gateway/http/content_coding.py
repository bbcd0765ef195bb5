"""Request bodies sent compressed: ``Content-Encoding: gzip`` and ``deflate`` are decoded (zlib, in C), never
past the gateway's body limit, so a small compressed bomb cannot expand into memory; any other coding gets
415 with the codings taken in ``Accept-Encoding`` (RFC 9110 15.5.16). Clients that send large prompts over
slow links compress them; without this their bodies failed as "not valid JSON"."""

from __future__ import annotations

import zlib

from gateway.http.errors import GatewayError, InvalidRequest, PayloadTooLarge

ACCEPTED = "gzip, deflate"
GZIP_WBITS = 16 + zlib.MAX_WBITS
ZLIB_WBITS = zlib.MAX_WBITS  # "deflate" is the zlib format (RFC 9110 8.4.1.2) ...
RAW_DEFLATE_WBITS = -zlib.MAX_WBITS  # ... but some clients send bare deflate


class UnsupportedEncoding(GatewayError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


_IDENTITY = ("", "identity")  # (no coding)


def _codings(content_encoding: str) -> list[str]:
    return [c.strip().lower() for c in content_encoding.split(",")]


def is_compressed(content_encoding: str | None) -> bool:
    """Whether a body sent with this ``Content-Encoding`` has a coding to undo: its size on the wire then
    says nothing of its size decoded."""
    return content_encoding is not None and any(c not in _IDENTITY for c in _codings(content_encoding))


def decode_body(raw: bytes, content_encoding: str, limit: int) -> bytes:
    """``raw`` with its codings undone, last applied first; PayloadTooLarge past ``limit`` decoded bytes,
    InvalidRequest for a body that is not what its coding says, UnsupportedEncoding for a coding not taken."""
    for coding in reversed(_codings(content_encoding)):
        if coding in _IDENTITY:
            continue
        if coding in ("gzip", "x-gzip"):
            raw = _inflate(raw, GZIP_WBITS, coding, limit)
        elif coding == "deflate":
            raw = _inflate(raw, ZLIB_WBITS if _zlib_header(raw) else RAW_DEFLATE_WBITS, coding, limit)
        else:
            raise UnsupportedEncoding(
                f"Content-Encoding {coding[:40]!r} is not supported; send the body as is, or as {ACCEPTED}",
                headers={"Accept-Encoding": ACCEPTED},
            )
    return raw


def _zlib_header(raw: bytes) -> bool:
    """Whether ``raw`` opens with a zlib header (RFC 1950: method 8, header a multiple of 31)."""
    return len(raw) >= 2 and raw[0] & 0x0F == 8 and (raw[0] << 8 | raw[1]) % 31 == 0


def _inflate(raw: bytes, wbits: int, coding: str, limit: int) -> bytes:
    out: list[bytes] = []
    size = 0
    rest = raw
    while True:  # a gzip body may hold several members, one after another
        inflater = zlib.decompressobj(wbits)
        try:
            chunk = inflater.decompress(rest, limit + 1 - size)
        except zlib.error as exc:
            raise InvalidRequest(f"request body is not valid {coding} data: {exc}") from None
        size += len(chunk)
        if size > limit or inflater.unconsumed_tail:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit once decoded ({coding})")
        if not inflater.eof:
            raise InvalidRequest(f"request body is cut short: its {coding} data does not end")
        out.append(chunk)
        rest = inflater.unused_data
        if not rest or wbits != GZIP_WBITS:
            break
    if rest:
        raise InvalidRequest(f"request body has bytes after the end of its {coding} data")
    return out[0] if len(out) == 1 else b"".join(out)
