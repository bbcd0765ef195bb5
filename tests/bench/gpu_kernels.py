"""The engine's Triton kernels against torch eager, and a decode step against its memory-bandwidth limit.

    python tests/bench/gpu_kernels.py              # a CUDA GPU (sized for an H200: about 2 minutes)
    python tests/bench/gpu_kernels.py --dry-run    # CPU, Triton's interpreter, tiny shapes: checks the script

1. Each kernel, at Llama-3-8B shapes (bf16), timed against the torch code the engine runs without Triton
   (the same reference functions, eager), with the largest difference between the two outputs. Attention
   is timed through the engine's ``paged_attention`` (KV store included on both sides), so its torch side
   is the batched SDPA path the engine used before the kernels.
2. A whole decode step of a random Llama-3-8B-shaped model (forward + logits of each sequence's token), at
   several batch sizes and context lengths, Triton kernels vs torch eager; the bytes the step must read
   (every weight once, plus each sequence's K and V in every layer) divided by the time is its achieved
   bandwidth, held against a device-to-device copy measured in the same run (the practical limit) and the
   device's nominal bandwidth (``--peak-tbps``, 4.8 for an H200). Also timed replayed from a CUDA graph,
   which removes the Python and launch overhead that eager decoding pays at small batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

if "--dry-run" in sys.argv:  # Triton decides interpret-or-compile for its own library when first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch


@dataclass(frozen=True)
class Shapes:
    """A Llama-class model's dimensions and the workloads timed on it."""

    hidden: int
    intermediate: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    block: int
    tokens: int  # prefill-sized kernels
    decode_batch: int  # decode-sized kernels
    context: int  # decode attention's context per sequence
    prefill_seqs: tuple[tuple[int, int], ...]  # (cached, new) per sequence of the prefill attention case
    steps: tuple[tuple[int, int], ...]  # (batch, context) of each decode step measured


FULL = Shapes(
    hidden=4096,
    intermediate=14336,
    layers=32,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    vocab=128256,
    block=16,
    tokens=4096,
    decode_batch=64,
    context=4096,
    prefill_seqs=((0, 2048), (2048, 2048)),
    steps=((1, 4096), (16, 4096), (64, 4096), (256, 1024)),
)
TINY = Shapes(
    hidden=64,
    intermediate=96,
    layers=2,
    q_heads=4,
    kv_heads=2,
    head_dim=16,
    vocab=128,
    block=8,
    tokens=16,
    decode_batch=3,
    context=20,
    prefill_seqs=((0, 12), (9, 5)),
    steps=((2, 20),),
)


class Timer:
    """Median milliseconds of a callable: CUDA events between L2 flushes on a GPU, wall clock on CPU."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device = device
        self.reps = reps
        self.flush = (
            torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None
        )

    def __call__(self, fn: Callable[[], Any]) -> float:
        fn()  # compile / warm up
        times = []
        for _ in range(self.reps):
            if self.flush is not None:
                self.flush.zero_()  # evict the previous run's data from L2
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def max_diff(a: Any, b: Any) -> float:
    if isinstance(a, tuple):
        return max(max_diff(x, y) for x, y in zip(a, b, strict=True))
    return float((a.float() - b.float()).abs().max())


def forcing_torch(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with the engine's dispatch pinned to torch (what the engine runs where Triton is absent)."""
    from engine.kernels import ops

    def run() -> Any:
        saved = ops.use_triton
        ops.use_triton = lambda t: False  # type: ignore[assignment]
        try:
            return fn()
        finally:
            ops.use_triton = saved  # type: ignore[assignment]

    return run


def row(name: str, shape: str, ours_ms: float, torch_ms: float, diff: float, megabytes: float) -> None:
    """One kernel's line; ``megabytes`` moved by the Triton kernel, so MB/ms is its GB/s."""
    speedup = torch_ms / ours_ms
    print(
        f"{name:34s} {shape:36s} {ours_ms:9.3f} {torch_ms:9.3f} {speedup:7.2f}x {diff:9.1e} "
        f"{megabytes / ours_ms:8.0f}"
    )


def kernels(s: Shapes, device: torch.device, dtype: torch.dtype, timer: Timer) -> None:
    from engine.attention import SeqSlice, build_metadata, paged_attention
    from engine.kernels import activation, kv_store, norm, rotary

    g = torch.Generator().manual_seed(0)  # permutations, on the host
    g_device = torch.Generator(device=device).manual_seed(0)  # data, made where it is used (GBs of it)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g_device, device=device, dtype=dtype)

    size = dtype.itemsize
    print(
        f"{'kernel':34s} {'shape':36s} {'triton ms':>9s} {'torch ms':>9s} {'speedup':>8s} {'max diff':>9s} "
        f"{'GB/s':>8s}"
    )
    t, h = s.tokens, s.hidden
    for tokens in (t, s.decode_batch):
        x, res, w = randn(tokens, h), randn(tokens, h), 1 + 0.1 * randn(h)
        ours = norm.rms_norm_triton(x, w, 1e-5, res)
        diff = max_diff(ours, norm.rms_norm_torch(x, w, 1e-5, res))
        ms = timer(lambda x=x, w=w, res=res: norm.rms_norm_triton(x, w, 1e-5, res))
        base = timer(lambda x=x, w=w, res=res: norm.rms_norm_torch(x, w, 1e-5, res))
        row("rms_norm + residual", f"{tokens}x{h}", ms, base, diff, 4 * tokens * h * size / 1e6)

    qkv = randn(t, (s.q_heads + 2 * s.kv_heads) * s.head_dim)
    q = qkv[:, : s.q_heads * s.head_dim].view(t, s.q_heads, s.head_dim)
    k = qkv[:, s.q_heads * s.head_dim : (s.q_heads + s.kv_heads) * s.head_dim].view(t, s.kv_heads, s.head_dim)
    angles = torch.arange(t, device=device).float()[:, None] / 10000 ** (
        torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim
    )
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    diff = max_diff(rotary.rotary_triton(q, k, cos, sin), rotary.rotary_torch(q, k, cos, sin))
    ms, base = (
        timer(lambda: rotary.rotary_triton(q, k, cos, sin)),
        timer(lambda: rotary.rotary_torch(q, k, cos, sin)),
    )
    moved = 2 * t * (s.q_heads + s.kv_heads) * s.head_dim * size + 2 * t * s.head_dim * size
    row("rotary (q and k)", f"{t}x({s.q_heads}+{s.kv_heads})x{s.head_dim}", ms, base, diff, moved / 1e6)

    merged = randn(t, 2 * s.intermediate)
    gate, up = merged[:, : s.intermediate], merged[:, s.intermediate :]
    diff = max_diff(activation.silu_and_mul_triton(gate, up), activation.silu_and_mul_torch(gate, up))
    ms = timer(lambda: activation.silu_and_mul_triton(gate, up))
    base = timer(lambda: activation.silu_and_mul_torch(gate, up))
    row("silu_and_mul", f"{t}x{s.intermediate}", ms, base, diff, 3 * t * s.intermediate * size / 1e6)

    slots_total = 4 * t
    kv_shape = (slots_total, s.kv_heads, s.head_dim)
    k_cache, v_cache = randn(*kv_shape), randn(*kv_shape)
    kn, vn = randn(t, s.kv_heads, s.head_dim), randn(t, s.kv_heads, s.head_dim)
    slot_mapping = torch.randperm(slots_total, generator=g).to(device)[:t]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv_store.store_kv_torch(kn, vn, ref_k, ref_v, slot_mapping)
    kv_store.store_kv_triton(kn, vn, k_cache, v_cache, slot_mapping)
    diff = max_diff((k_cache, v_cache), (ref_k, ref_v))
    ms = timer(lambda: kv_store.store_kv_triton(kn, vn, k_cache, v_cache, slot_mapping))
    base = timer(lambda: kv_store.store_kv_torch(kn, vn, k_cache, v_cache, slot_mapping))
    row("store_kv", f"{t}x{s.kv_heads}x{s.head_dim}", ms, base, diff, 4 * kn.numel() * size / 1e6)

    def attention_case(name: str, seqs: list[tuple[int, int]]) -> None:
        """(cached, new) per sequence, through paged_attention both ways."""
        blocks = [-(-(c + n) // s.block) for c, n in seqs]
        order = torch.randperm(sum(blocks), generator=g).tolist()
        tables, used = [], 0
        for n in blocks:
            tables.append(order[used : used + n])
            used += n
        shape = (sum(blocks) * s.block, s.kv_heads, s.head_dim)
        kc, vc = randn(*shape), randn(*shape)
        meta = build_metadata(
            [SeqSlice(tb, c, n) for tb, (c, n) in zip(tables, seqs, strict=True)], s.block, device
        )
        tokens = meta.num_tokens
        qa, ka, va = (
            randn(tokens, s.q_heads, s.head_dim),
            randn(tokens, s.kv_heads, s.head_dim),
            randn(tokens, s.kv_heads, s.head_dim),
        )

        def run() -> torch.Tensor:
            return paged_attention(qa, ka, va, kc, vc, meta, s.head_dim**-0.5)

        diff = max_diff(run(), forcing_torch(run)())
        ms, base = timer(run), timer(forcing_torch(run))
        kv_read = sum(c + n for c, n in seqs) * 2 * s.kv_heads * s.head_dim * size
        context = sorted({c + n for c, n in seqs})
        shape_text = f"{len(seqs)} seqs, {tokens} new, ctx {context[0]}..{context[-1]}"
        row(name, shape_text, ms, base, diff, kv_read / 1e6)

    attention_case("paged decode attention", [(s.context - 1, 1)] * s.decode_batch)
    attention_case("paged decode attention", [(8 * s.context - 1, 1)])  # one long sequence: split-K
    attention_case("prefill attention (cached prefix)", list(s.prefill_seqs))


def random_model(s: Shapes, device: torch.device, dtype: torch.dtype) -> Any:
    from engine.model.config import ModelConfig
    from engine.model.llama import CausalLM

    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.q_heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    )
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype).eval()
    model.tie_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.05) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return model


def decode_steps(s: Shapes, device: torch.device, dtype: torch.dtype, timer: Timer, peak_tbps: float) -> None:
    from engine.attention import KVCache, SeqSlice, build_metadata

    model = random_model(s, device, dtype)
    size = dtype.itemsize
    # Each step reads every weight once except the embedding (one row per token)
    weight_bytes = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if not n.endswith("embed_tokens.weight")
    )
    copy_src = torch.empty(2 * 2**30 if device.type == "cuda" else 2**24, dtype=torch.int8, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = timer(lambda: copy_dst.copy_(copy_src))
    copy_tbps = 2 * copy_src.numel() / copy_ms / 1e9  # bytes read + written
    print(
        f"\nweights {weight_bytes / 1e9:.2f} GB; device-to-device copy {copy_tbps:.2f} TB/s measured, "
        f"{peak_tbps:.2f} TB/s nominal"
    )
    print(
        "decode step: forward + logits for B sequences of ctx tokens; 'graph': the Triton step replayed\n"
        "from a CUDA graph; limit: (weights + KV read) / measured copy bandwidth; TB/s and % of copy and\n"
        "of peak: bytes / the faster Triton time\n"
    )
    print(
        f"{'step':18s} {'KV GB':>7s} {'torch ms':>9s} {'triton ms':>9s} {'graph ms':>9s} "
        f"{'limit ms':>9s} {'TB/s':>6s} {'of copy':>8s} {'of peak':>8s}"
    )
    for batch, context in s.steps:
        blocks_per_seq = -(-context // s.block)
        cache = KVCache(s.layers, batch * blocks_per_seq, s.block, s.kv_heads, s.head_dim, dtype, device)
        tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
        meta = build_metadata([SeqSlice(t, context - 1, 1) for t in tables], s.block, device)
        ids = torch.randint(0, s.vocab, (batch,), device=device)
        positions = torch.full((batch,), context - 1, device=device)

        def step(
            ids: torch.Tensor = ids, positions: torch.Tensor = positions, cache: Any = cache, meta: Any = meta
        ) -> torch.Tensor:
            with torch.inference_mode():
                return model.compute_logits(model(ids, positions, cache, meta))

        kv_bytes = batch * context * s.layers * 2 * s.kv_heads * s.head_dim * size
        total = weight_bytes + kv_bytes
        torch_ms = timer(forcing_torch(step))
        ours_ms = timer(step)
        graph_ms = float("nan")
        if device.type == "cuda":
            try:
                graph_ms = timer(captured(step))
            except Exception as exc:  # report and go on: the eager figures stand on their own
                print(f"  (CUDA graph capture failed: {type(exc).__name__}: {exc})")
        best = min(ours_ms, graph_ms) if graph_ms == graph_ms else ours_ms  # NaN: no graph
        achieved = total / best / 1e9  # TB/s
        limit_ms = total / copy_tbps / 1e9
        print(
            f"B={batch:<4d} ctx={context:<6d} {kv_bytes / 1e9:7.2f} {torch_ms:9.3f} {ours_ms:9.3f} "
            f"{graph_ms:9.3f} {limit_ms:9.3f} {achieved:6.2f} {achieved / copy_tbps:8.0%} "
            f"{achieved / peak_tbps:8.0%}"
        )
        del cache, meta
        if device.type == "cuda":
            torch.cuda.empty_cache()


def captured(step: Callable[[], torch.Tensor]) -> Callable[[], Any]:
    """``step`` recorded once into a CUDA graph; the returned callable replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on a side stream: kernels compiled, allocator settled
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="nominal memory bandwidth (H200: 4.8)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_kernels: no CUDA device; use --dry-run to check the script on CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    # The interpreter has no bf16 arithmetic (our kernels compute in float32, the dots too, there)
    dtype = getattr(torch, args.dtype)
    shapes = TINY if args.dry_run else FULL
    timer = Timer(device, 1 if args.dry_run else args.reps)
    started = time.perf_counter()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter, tiny shapes)"
    print(f"device: {name}; dtype {args.dtype}; median of {timer.reps} runs\n")
    kernels(shapes, device, dtype, timer)
    decode_steps(shapes, device, dtype, timer, args.peak_tbps)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
