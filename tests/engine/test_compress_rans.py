"""The entropy coder: frequency tables, the numpy reference and the native extension writing the same bytes,
round trips for every float kind, near-entropy sizes, and streams that cannot be what an encoder wrote."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.compress import codec, rans
from engine.compress.float_split import KIND_BF16, KIND_F16, KIND_F32, REST_WIDTH, merge, split

needs_native = pytest.mark.skipif(
    not codec.native_available(), reason="the _rans extension is not built (pip install -e . builds it)"
)


def weights(n: int, dtype: torch.dtype, seed: int = 0) -> np.ndarray:
    """Weight-like values: normal with a per-column scale spread over many binades, as bytes."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, 0, 7)[torch.arange(n) % 7]
    return (torch.randn(n, generator=g) * 0.02 * scale).to(dtype).view(torch.uint8).numpy()


def entropy_bits(symbols: np.ndarray) -> float:
    p = np.bincount(symbols, minlength=256) / len(symbols)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def test_normalize_keeps_every_present_symbol_and_sums_to_the_scale() -> None:
    counts = np.zeros(256, dtype=np.int64)
    counts[[3, 4, 200]] = [10**6, 1, 5]
    freqs = rans.normalize(counts)
    assert int(freqs.sum()) == rans.SCALE
    assert np.all(freqs[[3, 4, 200]] >= 1) and np.count_nonzero(freqs) == 3
    assert freqs.max() < rans.SCALE
    with pytest.raises(ValueError, match="two distinct"):
        rans.normalize(np.eye(256, dtype=np.int64)[7])


@needs_native
@pytest.mark.parametrize("sizes", [[1], [7, 8, 9], [1000, 4093, 0], [20_000]])
def test_numpy_and_native_encoders_write_the_same_bytes(sizes: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    alphabet = rng.choice(256, size=12, replace=False)
    probabilities = rng.dirichlet(np.full(12, 0.3))
    chunks = [rng.choice(alphabet, size=n, p=probabilities).astype(np.uint8) for n in sizes]
    everything = np.concatenate([*chunks, alphabet.astype(np.uint8)])  # every symbol present at least once
    freqs = rans.normalize(np.bincount(everything, minlength=256))
    native = codec.encode(chunks, freqs)
    assert native == rans.encode_numpy(chunks, freqs)
    decoded = rans.decode_numpy(native, sizes, rans.decode_table(freqs))
    for row, chunk in enumerate(chunks):
        assert np.array_equal(decoded[row, : len(chunk)], chunk)


@needs_native
@pytest.mark.parametrize(
    ("kind", "dtype"), [(KIND_BF16, torch.bfloat16), (KIND_F16, torch.float16), (KIND_F32, torch.float32)]
)
@pytest.mark.parametrize("native_decoder", [True, False], ids=["native", "numpy"])
def test_every_float_kind_round_trips_bit_for_bit(
    kind: int, dtype: torch.dtype, native_decoder: bool
) -> None:
    raw = weights(5003, dtype)
    symbols, rest = split(raw, kind)
    assert np.array_equal(merge(symbols, rest, kind), raw)
    freqs = rans.normalize(np.bincount(symbols, minlength=256))
    bounds = [(0, 2048), (2048, 4096), (4096, 5003)]
    width = REST_WIDTH[kind]
    streams = [memoryview(s) for s in codec.encode([symbols[lo:hi] for lo, hi in bounds], freqs)]
    rests = [memoryview(rest[lo * width : hi * width].tobytes()) for lo, hi in bounds]
    outs = [np.empty((hi - lo) * raw.size // len(symbols), dtype=np.uint8) for lo, hi in bounds]
    table = rans.decode_table(freqs)
    if native_decoder:
        for stream, part, out in zip(streams, rests, outs, strict=True):
            codec.decode_into(stream, table, part, out, kind)
    else:
        codec.decode_numpy_into(streams, rests, table, outs, kind)
    assert np.array_equal(np.concatenate(outs), raw)


@needs_native
@pytest.mark.parametrize(
    ("kind", "dtype"), [(KIND_BF16, torch.bfloat16), (KIND_F16, torch.float16), (KIND_F32, torch.float32)]
)
def test_native_split_and_histogram_match_numpy(kind: int, dtype: torch.dtype) -> None:
    raw = weights(999, dtype, seed=7)
    symbols, rest, counts = codec.split_and_count(raw, kind)
    expected_symbols, expected_rest = split(raw, kind)
    assert np.array_equal(symbols, expected_symbols) and np.array_equal(rest, expected_rest)
    assert np.array_equal(counts, np.bincount(expected_symbols, minlength=256))


def test_numpy_path_round_trips_on_its_own(numpy_path: None) -> None:
    assert not codec.native_available()
    symbols, _ = split(weights(3001, torch.bfloat16), KIND_BF16)
    freqs = rans.normalize(np.bincount(symbols, minlength=256))
    streams = codec.encode([symbols[:1500], symbols[1500:]], freqs)
    decoded = rans.decode_numpy(streams, [1500, 1501], rans.decode_table(freqs))
    assert np.array_equal(np.concatenate([decoded[0, :1500], decoded[1]]), symbols)


def test_coded_size_is_within_a_hundredth_of_a_bit_of_the_order0_entropy() -> None:
    symbols, _ = split(weights(1 << 17, torch.bfloat16, seed=3), KIND_BF16)
    freqs = rans.normalize(np.bincount(symbols, minlength=256))
    (stream,) = codec.encode([symbols], freqs)
    bits = 8 * len(stream) / len(symbols)  # final states included
    assert entropy_bits(symbols) <= bits < entropy_bits(symbols) + 0.01


@needs_native
@pytest.mark.parametrize(
    ("kind", "dtype"), [(KIND_BF16, torch.bfloat16), (KIND_F16, torch.float16), (KIND_F32, torch.float32)]
)
def test_native_sse_and_scalar_decoders_agree_and_refuse_damage(kind: int, dtype: torch.dtype) -> None:
    """The SSE4.1 loop (whole rounds of 16 symbols) and the scalar loop (every symbol; the tail of a chunk
    and CPUs without SSE4.1) decode every size to the original bytes, and both refuse a damaged stream."""
    native = codec.native_module()
    assert native is not None
    for n in (15, 16, 17, 100, 4096 + 33, 20_000):
        raw = weights(n, dtype, seed=n)
        symbols, rest = split(raw, kind)
        freqs = rans.normalize(np.bincount(symbols, minlength=256))
        (stream,) = codec.encode([symbols], freqs)
        table = codec.table_for(freqs)
        altered = bytearray(stream)
        altered[len(stream) - 3] ^= 0x10  # a word read by the last rounds
        for simd in (True, False):
            out = np.zeros_like(raw)
            native.decode(stream, table, rest.tobytes(), out, n, kind, simd)
            assert np.array_equal(out, raw), (n, simd)
            for bad in (stream[:-1], stream[:-2], bytes(altered)):
                with pytest.raises(ValueError):
                    native.decode(bad, table, rest.tobytes(), out, n, kind, simd)


@needs_native
def test_many_chunks_in_one_native_call_name_the_bad_one() -> None:
    """decode_chunks over consecutive payloads gives what chunk-by-chunk decoding gives; a damaged stream
    is reported with its chunk's index, and a layout that does not add up is refused before decoding."""
    raw = weights(3 * 5000 + 123, torch.bfloat16, seed=9)
    symbols, rest = split(raw, KIND_BF16)
    bounds = [(0, 5000), (5000, 10000), (10000, 15000), (15000, len(symbols))]
    freqs = rans.normalize(np.bincount(symbols, minlength=256))
    streams = codec.encode([symbols[lo:hi] for lo, hi in bounds], freqs)
    table = codec.table_for(freqs)
    layout = np.array([(len(s), hi - lo) for s, (lo, hi) in zip(streams, bounds, strict=True)], np.int64)

    def payloads(damaged: int = -1) -> memoryview:
        parts = []
        for k, (stream, (lo, hi)) in enumerate(zip(streams, bounds, strict=True)):
            body = bytearray(stream)
            if k == damaged:
                body[len(body) // 2] ^= 0x20
            parts.append(bytes(body) + rest[lo:hi].tobytes())
        return memoryview(b"".join(parts))

    out = np.zeros_like(raw)
    codec.decode_chunks_into(payloads(), layout, table, out, KIND_BF16)
    assert np.array_equal(out, raw)
    with pytest.raises(rans.StreamError) as caught:
        codec.decode_chunks_into(payloads(damaged=2), layout, table, out, KIND_BF16)
    assert caught.value.chunk == 2
    short = layout.copy()
    short[1, 1] -= 1  # one element fewer than the payloads and out hold
    with pytest.raises(ValueError, match="layout"):
        codec.decode_chunks_into(payloads(), short, table, out, KIND_BF16)


@pytest.mark.parametrize("native_decoder", [True, False], ids=["native", "numpy"])
def test_a_cut_or_altered_stream_is_refused(native_decoder: bool) -> None:
    if native_decoder and not codec.native_available():
        pytest.skip("the _rans extension is not built")
    symbols, rest = split(weights(4000, torch.bfloat16, seed=5), KIND_BF16)
    freqs = rans.normalize(np.bincount(symbols, minlength=256))
    (stream,) = codec.encode([symbols], freqs)
    table = rans.decode_table(freqs)
    altered = bytearray(stream)
    altered[len(stream) // 2] ^= 0x40
    for bad in (stream[:-4], stream[:-1], stream[:40], bytes(altered)):
        out = np.empty(2 * len(symbols), dtype=np.uint8)
        with pytest.raises(rans.StreamError):
            if native_decoder:
                codec.decode_into(memoryview(bad), table, memoryview(rest.tobytes()), out, KIND_BF16)
            else:
                codec.decode_numpy_into(
                    [memoryview(bad)], [memoryview(rest.tobytes())], table, [out], KIND_BF16
                )
