"""Interleaved rANS over bytes: frequency tables, and the coder in numpy (the format's reference).

A chunk of ``n`` symbols is coded by ``LANES`` 32-bit states in round robin (symbol ``i`` belongs to lane
``i % LANES``) sharing one stream of 16-bit words; probabilities have ``SCALE_BITS`` bits. The stream is the
``LANES`` final states (little-endian u32) followed by the words in the order the decoder reads them (round
by round, lane by lane). 32-bit states and 16 lanes let the native decoder run four lanes per SSE register.
``_rans.c`` implements the same algorithm natively; ``codec.py`` picks one. The numpy decoder runs every lane
of many chunks in lockstep, one round of ``LANES`` symbols per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LANES = 16
SCALE_BITS = 12
SCALE = 1 << SCALE_BITS
WORD_BITS = 16
RANS_L = 1 << 16  # states live in [RANS_L, 2**32) between symbols
_WORD_MASK = np.uint64((1 << WORD_BITS) - 1)


class StreamError(ValueError):
    """A stream that cannot be what the encoder wrote (too short, or not ending in the initial state);
    ``chunk`` is its index when many chunks were decoded in one call."""

    chunk: int = 0


def normalize(counts: np.ndarray) -> np.ndarray:
    """256 symbol counts -> uint32 frequencies summing to ``SCALE``: every present symbol gets at least 1 and
    the rest follows the counts, each step the one that costs the fewest bits. Needs two distinct symbols
    (a frequency must stay below ``SCALE``); a constant stream needs no coder."""
    counts = np.asarray(counts, dtype=np.float64)
    present = counts > 0
    if counts.shape != (256,) or present.sum() < 2:
        raise ValueError("normalize needs 256 counts with at least two distinct symbols")
    freqs = np.where(present, np.maximum(1, np.floor(counts * SCALE / counts.sum())), 0).astype(np.int64)
    # Cost in bits of giving one more (or one less) slot to a symbol: counts * log2((f+1)/f).
    while (excess := int(freqs.sum()) - SCALE) != 0:
        safe = np.maximum(freqs, 1)
        if excess < 0:
            gain = np.where(present, counts * np.log2((safe + 1) / safe), -np.inf)
            step = min(-excess, int(present.sum()))
            freqs[np.argsort(-gain, kind="stable")[:step]] += 1
        else:
            loss = np.where(freqs > 1, counts * np.log2(safe / np.maximum(safe - 1, 1)), np.inf)
            step = min(excess, int((freqs > 1).sum()))
            freqs[np.argsort(loss, kind="stable")[:step]] -= 1
    return freqs.astype(np.uint32)


def decode_table(freqs: np.ndarray) -> np.ndarray:
    """The decoder's 4096 slots, each ``symbol | (slot - start) << 8 | freq << 20`` (uint32)."""
    freqs = np.asarray(freqs, dtype=np.uint32)
    if freqs.shape != (256,) or int(freqs.sum()) != SCALE or int(freqs.max()) >= SCALE:
        raise ValueError("freqs must be 256 values summing to 4096, each below 4096")
    symbols = np.repeat(np.arange(256, dtype=np.uint32), freqs)
    starts = np.concatenate(([0], np.cumsum(freqs)[:-1])).astype(np.uint32)
    slots = np.arange(SCALE, dtype=np.uint32)
    return symbols | ((slots - starts[symbols]) << 8) | (freqs[symbols] << 20)


def encode_numpy(chunks: Sequence[np.ndarray], freqs: np.ndarray) -> list[bytes]:
    """Each uint8 chunk's stream; the chunks are coded in lockstep (last round first, as rANS requires)."""
    freqs64 = np.asarray(freqs, dtype=np.uint64)
    starts = np.concatenate(([0], np.cumsum(freqs64)[:-1])).astype(np.uint64)
    sizes = np.array([len(c) for c in chunks], dtype=np.int64)
    rounds = int(-(-sizes.max() // LANES)) if len(chunks) else 0
    symbols = np.zeros((len(chunks), rounds * LANES), dtype=np.uint8)
    for row, chunk in enumerate(chunks):
        symbols[row, : len(chunk)] = chunk
    if np.any((freqs64[symbols] == 0) & (np.arange(rounds * LANES) < sizes[:, None])):
        raise ValueError("a symbol has frequency 0")
    x = np.full((len(chunks), LANES), RANS_L, dtype=np.uint64)
    emitted = np.zeros((rounds, len(chunks), LANES), dtype=bool)
    words = np.zeros((rounds, len(chunks), LANES), dtype=np.uint16)
    lanes = np.arange(LANES)
    for r in range(rounds - 1, -1, -1):
        valid = r * LANES + lanes < sizes[:, None]  # [chunks, LANES]
        s = symbols[:, r * LANES : (r + 1) * LANES]
        f = np.where(valid, freqs64[s], np.uint64(1))
        emit = valid & (x >= f << np.uint64(32 - SCALE_BITS))  # coding would leave [RANS_L, 2**32)
        emitted[r], words[r] = emit, (x & _WORD_MASK).astype(np.uint16)
        x = np.where(emit, x >> np.uint64(WORD_BITS), x)
        coded = ((x // f) << np.uint64(SCALE_BITS)) + x % f + starts[s]
        x = np.where(valid, coded, x)
    # The decoder reads words round by round, lane by lane: the encoder's emissions in reverse.
    return [
        x[row].astype("<u4").tobytes() + words[:, row][emitted[:, row]].astype("<u2").tobytes()
        for row in range(len(chunks))
    ]


def decode_numpy(
    streams: Sequence[bytes | memoryview], sizes: Sequence[int], tables: np.ndarray
) -> np.ndarray:
    """Decode chunks in lockstep; ``tables`` is one decode table per chunk ([chunks, 4096] uint32) or one
    shared by all. Returns the symbols as [chunks, max(sizes)] uint8, zero past each chunk's size."""
    count = len(streams)
    sizes_a = np.asarray(sizes, dtype=np.int64)
    tables = np.broadcast_to(np.asarray(tables, dtype=np.uint32).reshape(-1, SCALE), (count, SCALE))
    heads, bodies = [], []
    for index, stream in enumerate(streams):
        raw = memoryview(stream).cast("B")
        if len(raw) < 4 * LANES or (len(raw) - 4 * LANES) % 2:
            raise StreamError(f"chunk {index}: a stream of {len(raw)} bytes cannot hold {LANES} states")
        heads.append(np.frombuffer(raw[: 4 * LANES], dtype="<u4"))
        bodies.append(np.frombuffer(raw[4 * LANES :], dtype="<u2"))
    x = np.array(heads, dtype=np.uint64).reshape(count, LANES)
    lengths = np.array([len(b) for b in bodies], dtype=np.int64)
    base = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    words = np.concatenate([*bodies, np.zeros(1, dtype=np.uint16)]).astype(np.uint64)
    read = np.zeros(count, dtype=np.int64)
    rows = np.arange(count)[:, None]
    rounds = int(-(-sizes_a.max() // LANES)) if count else 0
    out = np.zeros((count, rounds * LANES), dtype=np.uint8)
    lanes = np.arange(LANES)
    for r in range(rounds):
        valid = r * LANES + lanes < sizes_a[:, None]
        entry = tables[rows, (x & np.uint64(SCALE - 1)).astype(np.int64)].astype(np.uint64)
        out[:, r * LANES : (r + 1) * LANES] = (entry & np.uint64(0xFF)).astype(np.uint8)
        bias = (entry >> np.uint64(8)) & np.uint64(SCALE - 1)
        v = (entry >> np.uint64(20)) * (x >> np.uint64(SCALE_BITS)) + bias
        need = valid & (v < np.uint64(RANS_L))
        position = read[:, None] + np.cumsum(need, axis=1) - need  # lanes needing a word read in lane order
        if np.any(need & (position >= lengths[:, None])):
            bad = int(np.argmax(np.any(need & (position >= lengths[:, None]), axis=1)))
            raise StreamError(f"chunk {bad}: the rANS stream is too short for its symbol count")
        word = words[np.where(need, base[:, None] + position, len(words) - 1)]
        v = np.where(need, (v << np.uint64(WORD_BITS)) | word, v)
        x = np.where(valid, v, x)
        read += need.sum(axis=1)
    bad_end = (read != lengths) | np.any(x != np.uint64(RANS_L), axis=1)
    if np.any(bad_end):
        bad = int(np.argmax(bad_end))
        raise StreamError(f"chunk {bad}: the rANS stream does not end in its initial state")
    return out[:, : int(sizes_a.max()) if count else 0]
