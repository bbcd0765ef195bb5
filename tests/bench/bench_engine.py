"""kvgate's engine on a 50-100M-parameter random model on CPU, against transformers in the same run.

    python tests/bench/bench_engine.py [--model DIR] [--rounds 2]

1. decode throughput: 16 concurrent requests through the engine vs transformers' ``generate`` on the same
   16 prompts (one batch), tokens per second of the decode phase (prefill time excluded on both sides);
2. time to first token of a 2k-token prompt with 90 % of it in the prefix cache vs none of it;
3. peak memory (VmHWM) of each worker process, ours and transformers', and ours against weights + KV cache.
Each measurement runs in a fresh worker process, alternating ours and transformers'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 128, 64


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prompts(vocab: int) -> list[list[int]]:
    return [[(31 * i + 7 * j + 11) % (vocab - 3) + 3 for j in range(PROMPT_LEN)] for i in range(PROMPTS)]


def worker_ours(model: str) -> dict[str, float]:
    import torch

    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sequence import SamplingParams

    # KV cache sized to the work (16 x 192 tokens, then a 2k prompt twice), as one would deploy it.
    config = EngineConfig(model, num_kv_blocks=448, device="cpu", dtype="float32", max_num_seqs=16)
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ps = prompts(engine.model_config.vocab_size)
    engine.generate([ps[0][:16]], SamplingParams(max_tokens=2, temperature=0.0))  # warm up kernels
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    produced: dict[str, int] = {}
    decode_start = 0.0
    while engine.has_work():
        for o in engine.step():
            produced[o.request_id] = o.completion_tokens
        if not decode_start and len(produced) == PROMPTS:
            decode_start = time.perf_counter()  # every sequence has its first token: prefill is over
    elapsed = time.perf_counter() - decode_start
    assert all(n == NEW_TOKENS for n in produced.values())

    # Time to first token of a 2k-token prompt: 90 % of it cached, then none of it cached.
    vocab = engine.model_config.vocab_size
    long = [(13 * j + 5) % (vocab - 3) + 3 for j in range(2048)]
    engine.generate([long[:1843]], SamplingParams(max_tokens=1, temperature=0.0))  # puts 1840 tokens in cache
    ttft = {}
    for name, prompt in (("cached90", long), ("uncached", [(t + 1) % (vocab - 3) + 3 for t in long])):
        start = time.perf_counter()
        engine.add_request(name, prompt, SamplingParams(max_tokens=1, temperature=0.0))
        first = None
        while engine.has_work():
            for o in engine.step():
                if first is None:
                    first = time.perf_counter() - start
                    cached = o.cached_tokens
        ttft[name] = first
        ttft[name + "_cached_tokens"] = cached
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return {
        "tokens_per_s": PROMPTS * (NEW_TOKENS - 1) / elapsed,
        "ttft_cached90_s": ttft["cached90"],
        "ttft_uncached_s": ttft["uncached"],
        "cached_tokens": ttft["cached90_cached_tokens"],
        "peak_rss_mib": peak_rss_mib(),
        "weights_mib": weights / 2**20,
        "kv_cache_mib": engine.kv_cache.bytes / 2**20,
        "threads": torch.get_num_threads(),
    }


def worker_hf(model: str) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size)
    ids = torch.tensor(ps)  # all prompts have the same length: no padding needed
    mask = torch.ones_like(ids)

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
        assert out.shape[1] == PROMPT_LEN + new_tokens
        return time.perf_counter() - start

    with torch.inference_mode():
        hf.generate(ids[:1, :16], attention_mask=mask[:1, :16], max_new_tokens=2, do_sample=False)
        prefill = timed(1)  # the prefill and the first token
        total = timed(NEW_TOKENS)
    return {"tokens_per_s": PROMPTS * (NEW_TOKENS - 1) / (total - prefill), "peak_rss_mib": peak_rss_mib()}


def run_worker(kind: str, model: str) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, __file__, "--worker", kind, "--model", model],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="model directory (default: make a 'small' random model in a temp dir)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker_ours(args.model) if args.worker == "ours" else worker_hf(args.model)
        print(json.dumps(result))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "small-llama")
            subprocess.run(
                [sys.executable, "-m", "engine", "make-model", model, "--preset", "small"], check=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        ours, hf = [], []
        for _ in range(args.rounds):  # A B A B: both see the same machine state
            ours.append(run_worker("ours", model))
            hf.append(run_worker("hf", model))
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    o_tps, h_tps = med(ours, "tokens_per_s"), med(hf, "tokens_per_s")
    t_c, t_u = med(ours, "ttft_cached90_s"), med(ours, "ttft_uncached_s")
    o_mem, h_mem = med(ours, "peak_rss_mib"), med(hf, "peak_rss_mib")
    weights, kv = ours[0]["weights_mib"], ours[0]["kv_cache_mib"]
    cpus = os.cpu_count()
    print(f"model: {model} ({weights:.0f} MiB of fp32 weights), {cpus} CPUs, {args.rounds} rounds, medians")
    print(f"1. decode phase, {PROMPTS} concurrent x {NEW_TOKENS} tokens (prompts of {PROMPT_LEN}):")
    print(
        f"   kvgate {o_tps:.1f} tok/s, transformers generate {h_tps:.1f} tok/s -> ratio {o_tps / h_tps:.2f}"
    )
    print(
        f"2. TTFT of a 2048-token prompt: {int(ours[0]['cached_tokens'])} tokens cached {t_c * 1e3:.0f} ms, "
        f"none cached {t_u * 1e3:.0f} ms -> ratio {t_c / t_u:.3f} ({t_u / t_c:.1f}x faster)"
    )
    print(
        f"3. peak RSS: kvgate {o_mem:.0f} MiB (weights {weights:.0f} + KV cache {kv:.0f} MiB; "
        f"{o_mem / (weights + kv):.2f}x those), transformers {h_mem:.0f} MiB -> ratio {o_mem / h_mem:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
