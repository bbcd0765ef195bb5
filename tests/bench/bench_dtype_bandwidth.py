"""float32 against bfloat16 decode on this CPU: the kernels, kvgate's decode step, and the memory bandwidth.

    python tests/bench/bench_dtype_bandwidth.py [--model DIR] [--batch 16] [--contexts 128,1024] [--quick]
    python tests/bench/bench_dtype_bandwidth.py --threads 1 --cpu-time      # on a machine others load
    python tests/bench/bench_dtype_bandwidth.py --emulate-avx2              # as a CPU without AVX-512 runs

1. the CPU: its bf16 instructions (``lscpu`` flags avx512_bf16, amx_bf16), what torch sees of them and the
   oneDNN it carries;
2. memory bandwidth: copy and sum of 1 GiB arrays, numpy (one thread) and torch (all threads), GB/s;
3. ``F.linear`` at decode shapes (batch 1, 16, 64) for the layers of the two checkpoints of
   ``bench_engine_vs_vllm.py`` (h256, small) and an 8B-like 4096x4096, each dtype: ms per call, weight
   GB/s, and bf16/fp32; and which oneDNN implementation a bf16 matmul runs (``ONEDNN_VERBOSE``);
4. kvgate's CPU attention (``engine.attention.paged_attention``: store K/V, the gather, grouped
   matmuls) at batch 16 for 128- and 2k-token contexts, split into its parts;
5. torch's SDPA kernel alone at decode shapes (one query per sequence) and at a prefill shape, against the
   same decode attention as two grouped matmuls with a float32 softmax (``grouped_attention``);
6. a whole kvgate decode step (``engine.llm_engine.LLMEngine`` on the ``small`` checkpoint, a batch of 16,
   each of ``--contexts``) in each dtype, their steps interleaved: step time, tokens/s, bytes read per step
   (weights + KV) / step time against the measured bandwidth, and the torch.profiler op breakdown of the
   two steps side by side.

Timings of the two dtypes are interleaved call by call, so that load from other processes falls on both
alike. ``--model DIR`` reuses a checkpoint (else make_model's ``small`` preset is written to a temporary
directory); ``--kvgate-src DIR`` imports the engine from another source tree; ``--parts`` picks parts
(cpu,bandwidth,linear,onednn,attention,sdpa,step). ``--quick`` runs fewer repetitions and smaller arrays.

What it showed on a 2-core AMD EPYC with avx512_bf16 (no AMX), torch 2.13, one thread, CPU time: bf16
matmuls run oneDNN's native ``brg_matmul:avx512_core_bf16`` and take 0.2-0.45x the fp32 time at batch
16-64; torch's CPU SDPA at one query per sequence takes 5x the fp32 time in bf16 (prefill: 1.0x), and
grouped matmuls take 0.65x; so kvgate's bf16 decode step of the small model is 0.96x fp32 at 128-token
contexts but 2.25x at 1k (SDPA 314 of its 388 ms). Under ``--emulate-avx2`` bf16 matmuls leave oneDNN for
ATen's own bf16 gemm, 2-5x slower than fp32, and the step is 2x fp32 already at 128 tokens.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
DTYPES = (torch.float32, torch.bfloat16)
GB = 1e9


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def timed(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (the machine is shared: the median, not the mean)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


CLOCK = time.perf_counter  # --cpu-time: time.process_time (this process's CPU seconds, all threads)


def timed_many(fns: Sequence[Callable[..., object]], reps: int, warmup: int = 2) -> list[float]:
    """Median seconds of each of ``fns``, their calls interleaved (a, b, a, b, ...): what else runs on the
    machine meanwhile slows each alike, so their ratio holds where each one's own time would not."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times, strict=True):
            start = CLOCK()
            fn()
            out.append(CLOCK() - start)
    return [statistics.median(t) for t in times]


# -- 1. the CPU ---------------------------------------------------------------------------------------------


def cpu_report() -> None:
    flags: set[str] = set()
    model = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Flags:"):
                flags = set(line.split(":", 1)[1].split())
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
    print(
        f"CPU: {model}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print("  lscpu flags: " + ", ".join(f"{f}={'yes' if f in flags else 'no'}" for f in wanted))
    mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    print(
        f"  torch: cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"avx512_bf16 {torch.cpu._is_avx512_bf16_supported()}, "
        f"amx_tile {torch.cpu._is_amx_tile_supported()}, "
        f"mkldnn {mkldnn}"
    )
    config = torch.__config__.show()
    for line in config.splitlines():
        if "MKL-DNN" in line or "CPU capability" in line or "Math Kernel" in line:
            print("  " + line.strip(" -"))


# -- 2. bandwidth -------------------------------------------------------------------------------------------


def bandwidth(mib: int, reps: int) -> float:
    """Prints copy and reduction GB/s; returns the best read bandwidth (the roofline used below)."""
    n = mib * 2**20 // 4
    src = np.random.default_rng(0).random(n, dtype=np.float32)
    dst = np.empty_like(src)
    rows = []
    t = timed(lambda: np.copyto(dst, src), reps)
    rows.append(("numpy copy f32 (1 thread)", 2 * src.nbytes / t))
    t = timed(lambda: src.sum(), reps)
    rows.append(("numpy sum f32 (1 thread)", src.nbytes / t))
    dst = np.empty(0, dtype=np.float32)  # freed
    ts = torch.from_numpy(src)
    td = torch.empty_like(ts)
    t = timed(lambda: td.copy_(ts), reps)
    rows.append((f"torch copy f32 ({torch.get_num_threads()} threads)", 2 * ts.nbytes / t))
    t = timed(lambda: ts.sum(), reps)
    rows.append((f"torch sum f32 ({torch.get_num_threads()} threads)", ts.nbytes / t))
    td = torch.empty(0)  # freed
    tb = ts.to(torch.bfloat16)
    t = timed(lambda: tb.sum(), reps)
    rows.append((f"torch sum bf16 ({torch.get_num_threads()} threads)", tb.nbytes / t))
    # A kernel oddity worth knowing: a bf16 sum accumulated in float32 is far slower than either alone.
    t = timed(lambda: tb.sum(dtype=torch.float32), max(1, reps // 2))
    rows.append(("torch sum bf16 -> f32 accumulate", tb.nbytes / t))
    print(f"\nMemory bandwidth ({mib} MiB arrays; copy counts read + write):")
    for label, value in rows:
        print(f"  {label:<34} {value / GB:7.1f} GB/s")
    best = max(v for label, v in rows if "sum" in label)  # the best read rate any of them reached
    print(f"  read roofline used below: {best / GB:.1f} GB/s")
    return best


# -- 3. F.linear --------------------------------------------------------------------------------------------

SHAPES = {  # (in, out) of each linear layer of a decode step
    "h256": {
        "qkv": (256, 512), "o": (256, 256), "gate_up": (256, 2048), "down": (1024, 256),
        "lm_head": (256, 16384),
    },
    "small": {
        "qkv": (768, 1280), "o": (768, 768), "gate_up": (768, 4096), "down": (2048, 768),
        "lm_head": (768, 16384),
    },
    "8B-like": {"4096x4096": (4096, 4096)},
}  # fmt: skip


def linear_report(batches: list[int], reps: int) -> None:
    print("\nF.linear, ms per call (median), weight GB/s, bf16/fp32 time (below 1: bf16 faster):")
    print(
        f"  {'layer':<22} {'batch':>5} {'fp32 ms':>9} {'GB/s':>6} {'bf16 ms':>9} {'GB/s':>6} {'bf16/fp32':>9}"
    )
    for model, layers in SHAPES.items():
        for layer, (k, n) in layers.items():
            for b in batches:
                ws = [torch.randn(n, k, dtype=dtype) for dtype in DTYPES]
                xs = [torch.randn(b, k, dtype=dtype) for dtype in DTYPES]
                fns = [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws, strict=True)]
                cells = [(t, w.nbytes / t) for t, w in zip(timed_many(fns, reps), ws, strict=True)]
                ratio = cells[1][0] / cells[0][0]
                print(
                    f"  {model + ' ' + layer:<22} {b:>5} {cells[0][0] * 1e3:9.3f} {cells[0][1] / GB:6.1f} "
                    f"{cells[1][0] * 1e3:9.3f} {cells[1][1] / GB:6.1f} {ratio:9.2f}"
                )


ONEDNN_PROBE = """
import torch, torch.nn.functional as F
for b in (1, 16):
    x, w = torch.randn(b, 4096, dtype=torch.bfloat16), torch.randn(4096, 4096, dtype=torch.bfloat16)
    print("batch", b, flush=True)
    F.linear(x, w)
"""


def onednn_report() -> None:
    """Which implementation oneDNN picks for a bf16 matmul (none listed: ATen ran it without oneDNN)."""
    env = dict(os.environ, ONEDNN_VERBOSE="1", DNNL_VERBOSE="1")
    run = subprocess.run([sys.executable, "-c", ONEDNN_PROBE], capture_output=True, text=True, env=env)
    print("\noneDNN on a bf16 4096x4096 F.linear (ONEDNN_VERBOSE):")
    batch = "?"
    seen: dict[str, list[str]] = {}
    for line in run.stdout.splitlines():
        if line.startswith("batch"):
            batch = line.split()[1]
            seen.setdefault(batch, [])
        elif line.startswith("onednn_verbose") and (",exec," in line or ",create:" in line):
            fields = line.split(",")
            impl = next((f for f in fields if re.search(r"avx|amx|brg|gemm|ref|jit", f)), "?")
            if impl not in seen.setdefault(batch, []):
                seen[batch].append(impl)
        elif line.startswith("onednn_verbose") and "isa" in line.lower() and "info" in line:
            print("  " + line.strip())
    for b, impls in seen.items():
        print(f"  batch {b}: " + (", ".join(impls) if impls else "no oneDNN primitive: ATen's own bf16 gemm"))
    if run.returncode:
        print("  (probe failed: " + run.stderr.strip()[-300:] + ")")


# -- 4. attention -------------------------------------------------------------------------------------------


def attention_case(
    hq: int, hkv: int, d: int, ctx: int, batch: int, dtype: torch.dtype
) -> list[Callable[[], object]]:
    """paged_attention for one decode step of one layer, and its parts: the torch plan (built once per step
    on the host), the gather of the cached K/V, the grouped matmuls with their float32 softmax."""
    from engine.attention import SeqSlice, build_metadata, grouped_decode, paged_attention

    block = 32
    per_seq = -(-(ctx + 1) // block)
    slices = [SeqSlice(list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), ctx, 1) for i in range(batch)]
    slots = (1 + batch * per_seq) * block
    q, k, v = (torch.randn(batch, h, d, dtype=dtype) for h in (hq, hkv, hkv))
    kc, vc = torch.randn(slots, hkv, d, dtype=dtype), torch.randn(slots, hkv, d, dtype=dtype)
    meta = build_metadata(slices, block)
    plan = meta.torch_plan.decode
    assert plan is not None

    def gather() -> object:
        rows = plan.cache_rows(hkv)
        return tuple(c.view(-1, d).index_select(0, rows).view(batch, hkv, -1, d) for c in (kc, vc))

    return [
        lambda: paged_attention(q, k, v, kc, vc, meta, d**-0.5),
        lambda: build_metadata(slices, block).torch_plan,
        gather,
        lambda: grouped_decode(q, kc, vc, plan, d**-0.5),
    ]


def attention_report(batch: int, reps: int) -> None:
    from engine.host_memory import keep_freed_memory

    keep_freed_memory()  # as LLMEngine on CPU: the gathers' memory is not faulted in again each call
    print(
        f"\nkvgate's CPU attention (paged_attention: store, gather, grouped matmuls), batch {batch}, "
        "ms a layer:"
    )
    names = ("whole", "plan", "gather", "grouped")
    print(
        f"  {'heads q/kv, D':<14} {'context':>7}"
        + "".join(f" {n + ' f32':>11} {n + ' bf16':>11}" for n in names)
    )
    for hq, hkv, d in ((4, 2, 64), (12, 4, 64)):
        for ctx in (128, 2048):
            f32, bf16 = (attention_case(hq, hkv, d, ctx, batch, dtype) for dtype in DTYPES)
            with torch.inference_mode():
                times = timed_many(f32 + bf16, reps)
            cells = "".join(
                f" {a * 1e3:11.3f} {b * 1e3:11.3f}" for a, b in zip(times[:4], times[4:], strict=True)
            )
            print(f"  {f'{hq}/{hkv}, {d}':<14} {ctx:>7}" + cells)
    print("  (plan: block table rows and context mask, built once per step and shared by the layers;")
    print("   grouped: the gather included; glibc's malloc tuned as the engine tunes it)")


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Decode attention as two batched matmuls in the input dtype (oneDNN/MKL bf16 where the CPU has it)
    and a float32 softmax; the query heads of each KV head are grouped, so K/V are not repeated.
    q [B, Hq, 1, D], k/v [B, Hkv, L, D], mask [B, 1, 1, L] -> [B, Hq, 1, D]."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    scores = (q.view(b, hkv, hq // hkv, d) @ k.transpose(-1, -2)).float() * d**-0.5  # [B, Hkv, G, L]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
    return (probs @ v).view(b, hq, 1, d)


def sdpa_report(batch: int, reps: int) -> None:
    """torch's SDPA kernel alone at decode (one query) and prefill shapes, and ``grouped_attention``."""
    print(
        f"\ntorch SDPA on CPU alone (12 query heads, 4 KV heads, D 64), ms; decode: batch {batch} x 1 query:"
    )
    print(f"  {'shape':<34} {'fp32':>9} {'bf16':>9} {'bf16/fp32':>9}")
    hq, hkv, d = 12, 4, 64
    for label, b, lq, lk in (
        ("decode, context 128", batch, 1, 128),
        ("decode, context 2048", batch, 1, 2048),
        ("prefill 2048 tokens", 1, 2048, 2048),
    ):
        fns, alt = [], []
        for dtype in DTYPES:
            q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).expand(b, 1, lq, lk)
            fns.append(
                lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, enable_gqa=True
                )
            )
            alt.append(lambda q=q, k=k, v=v, mask=mask: grouped_attention(q, k, v, mask))
        rows = [(f"SDPA {label}", fns)]
        if lq == 1:
            rows.append((f"grouped matmuls {label}", alt))
        for name_, pair in rows:
            with torch.inference_mode():
                a, c = timed_many(pair, max(3, reps // (4 if lq > 1 else 1)))
            print(f"  {name_:<34} {a * 1e3:9.3f} {c * 1e3:9.3f} {c / a:9.2f}")


# -- 5. a whole decode step ---------------------------------------------------------------------------------


def decode_engine(model_dir: Path, dtype: torch.dtype, batch: int, steps: int, context: int) -> Any:
    """An LLMEngine with ``batch`` sequences of ``context``-token prompts, prefilled and 3 decode steps in."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sequence import SamplingParams

    config = EngineConfig(
        str(model_dir), block_size=32, num_kv_blocks=batch * ((context + steps + 60) // 32 + 1) + 8,
        device="cpu", dtype=name(dtype),
        max_num_seqs=batch,
    )  # fmt: skip
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(31 * i + 7 * j + 11) % (vocab - 40) + 20 for j in range(context)]
        engine.add_request(f"r{i}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunks and all) until every sequence has its first token
        started.update(o.request_id for o in engine.step())
    for _ in range(3):
        engine.step()
    return engine


def decode_step_report(
    model_dir: Path, batch: int, steps: int, roofline: float, top: int, context: int
) -> None:
    from torch.profiler import ProfilerActivity, profile

    print(
        f"\nkvgate decode step, {model_dir.name} checkpoint, batch {batch}, {context}-token prompts; dtypes'"
    )
    print("steps interleaved; wall ms (median, p10-p90) and process CPU ms (all threads) per step:")
    engines: dict[torch.dtype, Any] = {
        dtype: decode_engine(model_dir, dtype, batch, steps, context) for dtype in DTYPES
    }
    wall: dict[torch.dtype, list[float]] = {dtype: [] for dtype in DTYPES}
    cpu: dict[torch.dtype, list[float]] = {dtype: [] for dtype in DTYPES}
    for _ in range(steps):
        for dtype, engine in engines.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            outs = engine.step()
            wall[dtype].append(time.perf_counter() - start)
            cpu[dtype].append(time.process_time() - start_cpu)
            assert len(outs) == batch
    profiles: dict[torch.dtype, dict[str, list[float]]] = {dtype: {} for dtype in DTYPES}
    profiled = 5
    for _ in range(profiled):
        for dtype, engine in engines.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.step()
            for e in prof.key_averages():
                cell = profiles[dtype].setdefault(e.key, [0.0, 0.0])
                cell[0] += e.self_cpu_time_total / profiled
                cell[1] += e.count / profiled
    medians = {}
    for dtype, engine in engines.items():
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        mc = engine.model_config
        kv = batch * (context + 3 + steps) * mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim
        kv *= engine.kv_cache.k[0].element_size()
        step_s, best_s = statistics.median(wall[dtype]), min(wall[dtype])
        medians[dtype] = step_s
        read = weights + kv
        p10, p90 = (np.percentile(wall[dtype], q) * 1e3 for q in (10, 90))
        share = f" ({100 * read / step_s / roofline:.0f} % of {roofline / GB:.1f})" if roofline > 0 else ""
        print(
            f"  {name(dtype):<9} {step_s * 1e3:7.1f} ms ({p10:.1f}-{p90:.1f}), "
            f"CPU {statistics.median(cpu[dtype]) * 1e3:6.1f} ms, {batch / step_s:6.1f} tok/s; reads "
            f"{weights / 2**20:.0f} MiB weights + {kv / 2**20:.1f} MiB KV a step: "
            f"{read / step_s / GB:.2f} GB/s{share}, best step {read / best_s / GB:.2f} GB/s"
        )
    ratio = medians[torch.bfloat16] / medians[torch.float32]
    print(f"  bf16/fp32 step time: {ratio:.2f} ({'bf16 faster' if ratio < 1 else 'bf16 slower'})")
    f32, bf16 = profiles[torch.float32], profiles[torch.bfloat16]
    keys = sorted(set(f32) | set(bf16), key=lambda k: -max(f32.get(k, [0, 0])[0], bf16.get(k, [0, 0])[0]))
    print(f"\n  torch.profiler self CPU time per decode step, top {top} ops (ms; calls per step):")
    print(f"  {'op':<46} {'fp32 ms':>9} {'calls':>6} {'bf16 ms':>9} {'calls':>6} {'bf16-fp32':>10}")
    for key in keys[:top]:
        a, b = f32.get(key, [0.0, 0.0]), bf16.get(key, [0.0, 0.0])
        print(
            f"  {key[:46]:<46} {a[0] / 1e3:9.2f} {a[1]:6.0f} {b[0] / 1e3:9.2f} {b[1]:6.0f} "
            f"{(b[0] - a[0]) / 1e3:10.2f}"
        )
    total_a = sum(v[0] for v in f32.values()) / 1e3
    total_b = sum(v[0] for v in bf16.values()) / 1e3
    print(f"  {'(all ops)':<46} {total_a:9.2f} {'':6} {total_b:9.2f} {'':6} {total_b - total_a:10.2f}")
    casts = {k: (f32.get(k, [0, 0])[1], bf16.get(k, [0, 0])[1]) for k in ("aten::to", "aten::_to_copy")}
    print(
        "  casts per step (calls fp32 / bf16): "
        + ", ".join(f"{k} {a:.0f} / {b:.0f}" for k, (a, b) in casts.items())
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="the checkpoint of the decode step (default: a new `small`)")
    p.add_argument("--kvgate-src", type=Path, help="import kvgate's engine from this source tree")
    p.add_argument("--batch", type=int, default=16, help="decode batch of parts 4 and 5 (default: 16)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per dtype (default: 20)")
    p.add_argument(
        "--contexts",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[128, 1024],
        help="prompt lengths of the decode-step part (default: 128,1024)",
    )
    p.add_argument("--top", type=int, default=18, help="profiler ops shown (default: 18)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions, 256 MiB arrays")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, all cores)")
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="time parts 3 and 4 in process CPU seconds instead of wall seconds: on a machine others load, "
        "with --threads 1, the time this process really ran",
    )
    p.add_argument(
        "--emulate-avx2",
        action="store_true",
        help="run as on a CPU without AVX-512 (and so without its bf16 instructions): caps oneDNN "
        "(ONEDNN_MAX_CPU_ISA=AVX2) and ATen's kernels (ATEN_CPU_CAPABILITY=avx2)",
    )
    p.add_argument(
        "--parts",
        default="cpu,bandwidth,linear,onednn,attention,sdpa,step",
        help="which parts (default: all)",
    )
    args = p.parse_args(argv)
    if args.emulate_avx2 and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        # Both are read when torch loads and oneDNN starts: only a new process can set them.
        env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    sys.path.insert(0, str((args.kvgate_src or REPO).absolute()))
    parts = set(args.parts.split(","))
    reps = 5 if args.quick else 20
    torch.manual_seed(0)
    if "cpu" in parts:
        cpu_report()
    roofline = bandwidth(256 if args.quick else 1024, 3 if args.quick else 8) if "bandwidth" in parts else 0.0
    if "linear" in parts:
        linear_report([1, 16, 64], reps)
    if "onednn" in parts:
        onednn_report()
    if "attention" in parts:
        attention_report(args.batch, reps)
    if "sdpa" in parts:
        sdpa_report(args.batch, reps)
    if "step" in parts:
        with tempfile.TemporaryDirectory(prefix="kvgate-dtype-") as tmp:
            model = args.model
            if model is None:
                from engine.make_model import make_model

                model = make_model(Path(tmp) / "small", "small", seed=0, dtype="float32")
            for context in args.contexts:
                decode_step_report(model, args.batch, args.steps, roofline, args.top, context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
