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
    pieces, start = [], 0
    for chunk in entry.chunks:
        pieces.append(out[start : start + chunk.count * size])
        start += chunk.count * size
    kind = KINDS.get(entry.dtype, 0)
    if entry.codec in ("raw", "const") or (entry.codec == "rans" and not codec.native_available()):
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

    def one(i: int) -> None:
        stream, rest = reader.payload(entry, i, scratch=True)  # decoded before this thread reads again
        _check_lengths(reader, entry, [(stream, rest)], kind, size, first=i)
        try:
            codec.decode_into(stream, table, rest, pieces[i], kind)
        except rans.StreamError as exc:
            raise CorruptWeightsError(f"{reader.describe(entry, i)}: {exc}") from None

    _each(pool, one, len(entry.chunks))
    return out


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
