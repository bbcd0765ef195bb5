"""The frames of a KV transfer on the wire, without torch (the simulated engine speaks them too).

Frame: ``[u32 little-endian header length][msgpack header][payload]``; ``engine.kv_transfer`` says what the
headers mean and turns a ``kv`` frame's payload into tensors.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import msgpack

CONTENT_TYPE = "application/x-kvgate-kv"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the element types a kv frame may carry
LENGTH_BYTES = 4
_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 16


class KvTransferError(RuntimeError):
    """A transfer that broke, lied about its shapes, or ended early."""


class ByteSource(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


def pack(header: dict[str, Any], *payload: Any) -> list[Any]:
    """A frame as buffers for a single vectored write (``payload``: bytes-like buffers, sent as they are)."""
    return [head(header), *payload]


def head(header: dict[str, Any]) -> bytes:
    """A frame's length prefix and header, the small buffer written before the payload's own buffers."""
    packed: bytes = msgpack.packb(header)
    return _LEN.pack(len(packed)) + packed


def header_length(prefix: bytes) -> int:
    """The header length a frame's first ``LENGTH_BYTES`` bytes announce, checked."""
    (length,) = _LEN.unpack(prefix)
    if not 0 < length <= _MAX_HEADER:
        raise KvTransferError(f"frame header of {length} bytes")
    return int(length)


def parse_header(raw: bytes) -> dict[str, Any]:
    """A frame's header, checked: a ``kv`` header has integer fields and a known dtype, so that
    ``payload_bytes`` can be trusted to size the read that follows."""
    try:
        header = msgpack.unpackb(raw)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KvTransferError(f"frame header is not msgpack: {exc}") from None
    if not isinstance(header, dict) or header.get("t") not in ("kv", "done", "error"):
        raise KvTransferError(f"unknown frame {header!r}")
    if header["t"] == "kv":
        fields = ("layer", "start", "count", "heads", "dim")
        if header.get("dtype") not in DTYPE_BYTES or not all(
            type(header.get(f)) is int and header[f] >= 0 for f in fields
        ):
            raise KvTransferError(f"malformed kv frame header {header!r}")
    return header


async def read_header(source: ByteSource) -> dict[str, Any]:
    """The next frame's header, checked (``parse_header``)."""
    length = header_length(await source.readexactly(LENGTH_BYTES))
    return parse_header(await source.readexactly(length))


def payload_bytes(header: dict[str, Any]) -> int:
    """Bytes of a checked ``kv`` frame's payload: K then V, ``[count, heads, dim]`` each."""
    return int(2 * header["count"] * header["heads"] * header["dim"] * DTYPE_BYTES[header["dtype"]])
