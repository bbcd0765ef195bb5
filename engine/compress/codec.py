"""One tensor's entropy coding, through the native ``_rans`` extension when it is built, else numpy.

Both paths write and read the same bytes (tests hold them to it), so a checkpoint never depends on how the
package was installed. ``use_native(False)`` forces the numpy path.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from concurrent.futures import Executor
from types import ModuleType

import numpy as np

from engine.compress import rans
from engine.compress.float_split import REST_WIDTH, WORD, merge, split

OUT_WIDTH = {kind: int(word[-1]) for kind, word in WORD.items()}


def _load_native() -> ModuleType | None:
    try:
        module = importlib.import_module("engine.compress._rans")
    except ImportError:  # not built (no compiler at install time): numpy reads and writes the same format
        return None
    assert module.LANES == rans.LANES and module.SCALE_BITS == rans.SCALE_BITS
    return module


_native = _load_native()

_enabled = True


def native_available() -> bool:
    return _native is not None and _enabled


def native_module() -> ModuleType | None:
    """The extension, or None when it is not built or turned off (the palette form's CPU expansion too)."""
    return _native if native_available() else None


def use_native(enabled: bool) -> None:
    """Turn the native path off (tests compare the two) or back on."""
    global _enabled
    _enabled = enabled


def encode(chunks: Sequence[np.ndarray], freqs: np.ndarray, *, pool: Executor | None = None) -> list[bytes]:
    """Each uint8 symbol chunk's rANS stream under the frequencies ``freqs`` (256 uint32); the native path
    codes the chunks on ``pool``'s threads."""
    if native_available():
        assert _native is not None
        table = np.ascontiguousarray(freqs, dtype=np.uint32).tobytes()
        chunks = [np.ascontiguousarray(c) for c in chunks]
        native = _native

        def one(chunk: np.ndarray) -> bytes:
            return native.encode(chunk, table)  # type: ignore[no-any-return]

        return list(pool.map(one, chunks) if pool else map(one, chunks))
    return rans.encode_numpy(chunks, freqs)


def split_and_count(raw: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(symbols, rest, counts [256]) of a float tensor's bytes: float_split.split plus the histogram."""
    if native_available():
        assert _native is not None
        symbols, rest, counts = _native.split(np.ascontiguousarray(raw).reshape(-1), kind)
        return (
            np.frombuffer(symbols, dtype=np.uint8),
            np.frombuffer(rest, dtype=np.uint8),
            np.frombuffer(counts, dtype=np.uint64).astype(np.int64),
        )
    symbols, rest = split(raw, kind)
    return symbols, rest, np.bincount(symbols, minlength=256)


def table_for(freqs: np.ndarray) -> np.ndarray:
    """The decode table of ``freqs`` (4096 uint32); ValueError for frequencies no encoder writes."""
    if native_available():
        assert _native is not None
        freqs = np.ascontiguousarray(freqs, dtype=np.uint32)
        if freqs.shape != (256,):
            raise ValueError("freqs must be 256 values")
        return np.frombuffer(_native.decode_table(freqs.tobytes()), dtype=np.uint32)
    return rans.decode_table(freqs)


def decode_into(stream: memoryview, table: np.ndarray, rest: memoryview, out: np.ndarray, kind: int) -> None:
    """Decode one chunk natively into ``out`` (uint8, the chunk's bytes); the GIL is released meanwhile.
    Raises ``rans.StreamError`` for a stream that is not what the encoder wrote."""
    assert _native is not None
    n = out.size // OUT_WIDTH[kind]
    try:
        _native.decode(stream, table, rest, out, n, kind)
    except ValueError as exc:
        raise rans.StreamError(str(exc)) from None


def decode_chunks_into(
    payloads: memoryview, layout: np.ndarray, table: np.ndarray, out: np.ndarray, kind: int
) -> None:
    """Decode consecutive chunks natively in one call: ``payloads`` holds each chunk's stream then rest
    bytes, ``layout`` one (stream length, element count) int64 row per chunk, ``out`` (uint8) their elements.
    Raises ``rans.StreamError`` with ``chunk`` set to the first chunk that is not what the encoder wrote."""
    assert _native is not None
    bad = _native.decode_chunks(payloads, layout, table, out, kind)
    if bad is not None:
        index, why = bad
        error = rans.StreamError(why)
        error.chunk = index
        raise error


def decode_numpy_into(
    streams: Sequence[memoryview],
    rests: Sequence[memoryview],
    table: np.ndarray,
    outs: Sequence[np.ndarray],
    kind: int,
) -> None:
    """The numpy path: all chunks of a tensor decoded in lockstep, then merged with their rest bytes."""
    sizes = [len(r) // REST_WIDTH[kind] for r in rests]
    symbols = rans.decode_numpy(streams, sizes, table)
    for row, (rest, out, n) in enumerate(zip(rests, outs, sizes, strict=True)):
        out[:] = merge(symbols[row, :n], np.frombuffer(rest, dtype=np.uint8), kind)
