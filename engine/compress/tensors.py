"""One tensor in and out of a ``.kvgate`` file: pick its codec, cut it into chunks, code them in parallel.

Floats (BF16, F16, F32) are split into an exponent stream, rANS-coded with one frequency table per tensor,
and raw sign/mantissa bytes; a tensor with a single exponent (a norm's ones) stores that exponent once;
anything else, or a float tensor that would not shrink, is stored as it is. Chunks of ``CHUNK_ELEMENTS``
decode independently, on as many threads as the caller's pool has.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

import numpy as np

from engine.compress import codec, rans
from engine.compress.container import CorruptWeightsError, Reader, TensorEntry, Writer
from engine.compress.float_split import KINDS, REST_WIDTH, merge

_T = TypeVar("_T")
CHUNK_ELEMENTS = 1 << 17  # 256 KiB of BF16 per chunk: many chunks per tensor for threads, little overhead
ITEMSIZE = {
    "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    if dtype not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return ITEMSIZE[dtype] * math.prod(shape)


def encode_tensor(
    writer: Writer,
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    raw: np.ndarray,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
    pool: Executor | None = None,
) -> TensorEntry:
    """Write ``raw`` (the tensor's bytes, uint8) to ``writer``; returns its manifest entry."""
    count = math.prod(shape)
    assert raw.size == nbytes(dtype, shape), (name, raw.size, dtype, shape)
    kind = KINDS.get(dtype)
    bounds = [(lo, min(lo + chunk_elements, count)) for lo in range(0, count, chunk_elements)]
    if kind is not None and count:
        symbols, rest, counts = codec.split_and_count(raw, kind)
        width = REST_WIDTH[kind]
        present = np.flatnonzero(counts)
        if len(present) == 1:
            chunks = [writer.append(hi - lo, b"", rest[lo * width : hi * width].data) for lo, hi in bounds]
            return TensorEntry(name, dtype, shape, "const", tuple(chunks), symbol=int(present[0]))
        freqs = rans.normalize(counts)
        streams = codec.encode([symbols[lo:hi] for lo, hi in bounds], freqs, pool=pool)
        table_bytes = 4 * len(present)
        if sum(map(len, streams)) + rest.size + table_bytes < raw.size:
            chunks = [
                writer.append(hi - lo, stream, rest[lo * width : hi * width].data)
                for (lo, hi), stream in zip(bounds, streams, strict=True)
            ]
            freq_map = {int(s): int(freqs[s]) for s in present}
            return TensorEntry(name, dtype, shape, "rans", tuple(chunks), freqs=freq_map)
    size = ITEMSIZE[dtype]
    chunks = [writer.append(hi - lo, b"", raw[lo * size : hi * size].data) for lo, hi in bounds]
    return TensorEntry(name, dtype, shape, "raw", tuple(chunks))


def decode_tensor(
    reader: Reader, entry: TensorEntry, *, pool: Executor | None = None, out: np.ndarray | None = None
) -> np.ndarray:
    """The tensor's bytes, every chunk verified against its checksum: in a new uint8 array, or in ``out``
    (uint8, at least that long; the slice written is returned). Reusing one buffer for many tensors saves
    page faults, which cost a quarter of the decoding time on these machines."""
    size = ITEMSIZE.get(entry.dtype)
    count = math.prod(entry.shape)
    known = size is not None and entry.codec in ("raw", "const", "rans")
    if not known or sum(c.count for c in entry.chunks) != count:
        raise CorruptWeightsError(
            f"{reader.path}: tensor {entry.name!r}: the manifest's dtype, codec or chunk sizes disagree"
        )
    assert size is not None
    if out is None:
        out = np.empty(count * size, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.size < count * size:
        raise ValueError(f"out must be a uint8 array of at least {count * size} bytes")
    out = out[: count * size]
    kind = KINDS.get(entry.dtype, 0)
    if entry.codec in ("raw", "const") or (entry.codec == "rans" and not codec.native_available()):
        pieces, start = [], 0
        for chunk in entry.chunks:
            pieces.append(out[start : start + chunk.count * size])
            start += chunk.count * size
        payloads = _each(pool, lambda i: reader.payload(entry, i), len(entry.chunks))
        _check_lengths(reader, entry, payloads, kind, size)
        if entry.codec == "raw":
            for piece, (_, rest) in zip(pieces, payloads, strict=True):
                piece[:] = np.frombuffer(rest, dtype=np.uint8)
        elif entry.codec == "const":
            for piece, chunk, (_, rest) in zip(pieces, entry.chunks, payloads, strict=True):
                symbols = np.full(chunk.count, entry.symbol, dtype=np.uint8)
                piece[:] = merge(symbols, np.frombuffer(rest, dtype=np.uint8), kind)
        else:
            table = _table(reader, entry)
            try:
                streams, rests = [s for s, _ in payloads], [r for _, r in payloads]
                codec.decode_numpy_into(streams, rests, table, pieces, kind)
            except rans.StreamError as exc:
                raise CorruptWeightsError(f"{reader.path}: tensor {entry.name!r}: {exc}") from None
        return out

    table = _table(reader, entry)
    width = REST_WIDTH[kind]
    for i, chunk in enumerate(entry.chunks):  # the manifest's lengths first: the layout below relies on them
        if chunk.rest_len != chunk.count * width:
            where, expected = reader.describe(entry, i), chunk.count * width
            raise CorruptWeightsError(f"{where}: {chunk.rest_len} raw bytes, not {expected}")
    layout = np.array([(c.stream_len, c.count) for c in entry.chunks], dtype=np.int64).reshape(-1, 2)
    bounds = [0]
    for chunk in entry.chunks:
        bounds.append(bounds[-1] + chunk.count * size)

    def window(span: tuple[int, int]) -> None:
        first, last = span
        payloads = reader.window(entry, first, last)  # decoded before this thread reads again
        try:
            codec.decode_chunks_into(
                payloads, layout[first:last], table, out[bounds[first] : bounds[last]], kind
            )
        except rans.StreamError as exc:
            raise CorruptWeightsError(f"{reader.describe(entry, first + exc.chunk)}: {exc}") from None

    spans = _windows(entry)
    _each(pool, lambda k: window(spans[k]), len(spans))
    return out


WINDOW_BYTES = 1 << 20  # chunks read, checked and decoded together: one read, one native call


def _windows(entry: TensorEntry) -> list[tuple[int, int]]:
    """Runs of chunks consecutive in the file, each at most ``WINDOW_BYTES`` (or one chunk): small enough to
    stay in the cache between the read, the checksums and the decoding, and many per tensor for threads."""
    chunks, spans, first = entry.chunks, [], 0
    for i in range(1, len(chunks) + 1):
        if (
            i == len(chunks)
            or chunks[i].offset != chunks[i - 1].offset + chunks[i - 1].size
            or chunks[i].offset + chunks[i].size - chunks[first].offset > WINDOW_BYTES
        ):
            spans.append((first, i))
            first = i
    return spans


def _table(reader: Reader, entry: TensorEntry) -> np.ndarray:
    freqs = np.zeros(256, dtype=np.uint32)
    try:
        freqs[list(entry.freqs)] = list(entry.freqs.values())
        return codec.table_for(freqs)
    except (ValueError, IndexError, OverflowError) as exc:
        where = f"{reader.path}: tensor {entry.name!r}"
        raise CorruptWeightsError(f"{where}: bad frequency table: {exc}") from None


def _check_lengths(
    reader: Reader,
    entry: TensorEntry,
    payloads: list[tuple[memoryview, memoryview]],
    kind: int,
    size: int,
    first: int = 0,
) -> None:
    width = size if entry.codec == "raw" else REST_WIDTH[kind]
    for i, (_, rest) in enumerate(payloads, start=first):
        if len(rest) != entry.chunks[i].count * width:
            expected = entry.chunks[i].count * width
            raise CorruptWeightsError(f"{reader.describe(entry, i)}: {len(rest)} raw bytes, not {expected}")


def _each(pool: Executor | None, job: Callable[[int], _T], count: int) -> list[_T]:
    if pool is None or count < 2:
        return [job(i) for i in range(count)]
    return list(pool.map(job, range(count)))
