"""Which session a request belongs to: its ``x-session-affinity`` header, kvgate's own way to say it, or else
OpenAI's ``prompt_cache_key``, the body field with which OpenAI's SDK users ask for the same thing (requests
sharing a key and a prefix are routed to the same machine, to raise their cache hit rate). Both name a
session of the request's tenant, which the router keeps on the engine holding its prefix."""

from __future__ import annotations

from typing import Any

import xxhash

from gateway.http.errors import InvalidRequest

SESSION_HEADER = "x-session-affinity"
CACHE_KEY_FIELD = "prompt_cache_key"
# A key that could not be a header (spaces, non-ASCII, too long) is named by its digest behind this, which no
# header holds: a key with a space can then never be another binding's name (a stored response's, say).
_DIGEST_PREFIX = "prompt_cache_key "


def session_id(header: str | None, body: dict[str, Any], max_length: int) -> str | None:
    """The request's session: the header when it is sent (it wins over the body), else the body's
    ``prompt_cache_key`` (an empty one is none); None without either. A key that is a valid header value is
    that same session, so a client may move from one to the other and keep its engine."""
    if header is not None:
        if not _header_like(header, max_length):
            raise InvalidRequest(
                f"{SESSION_HEADER} must be 1 to {max_length} visible ASCII characters (no spaces)",
                param=SESSION_HEADER,
                code="invalid_header",
            )
        return header
    key = body.get(CACHE_KEY_FIELD)
    if key is None or key == "":
        return None
    if not isinstance(key, str):
        raise InvalidRequest(f"{CACHE_KEY_FIELD} must be a string", param=CACHE_KEY_FIELD)
    if _header_like(key, max_length):
        return key
    return _DIGEST_PREFIX + xxhash.xxh3_128_hexdigest(key.encode("utf-8", "surrogatepass"))


def _header_like(value: str, max_length: int) -> bool:
    return 0 < len(value) <= max_length and all("!" <= ch <= "~" for ch in value)
