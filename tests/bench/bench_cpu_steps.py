"""CPU time of kvgate's engine steps on the ``h256`` checkpoint of ``bench_engine_vs_vllm.py``, in process (no
HTTP): a figure that holds on a machine others load, where wall-clock throughput does not.

    python tests/bench/bench_cpu_steps.py [--dtypes float32,bfloat16] [--threads 1] [--streams 16,64]
    python tests/bench/bench_cpu_steps.py --kvgate-src ../kvgate-head   # a `git worktree` of another commit

Per dtype, one engine (block size 32, 2 GiB of KV cache, warmed up as the servers warm it): a cold
2000-token prompt (the median of 5, after one), the prefill step of ``--streams`` 128-token prompts, and
the decode steps of those streams (64 tokens each): milliseconds of CPU (``time.process_time``) per step,
the median. With ``--threads 1`` (the default) that is the step's cost, free of OpenMP spin-waiting.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_vs_vllm import build_model


def cpu_ms(fn: Any) -> float:
    started = time.process_time()
    fn()
    return (time.process_time() - started) * 1e3


def measure(model: Path, dtype: str, streams: list[int]) -> None:
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sequence import SamplingParams

    config = EngineConfig(
        str(model), block_size=32, dtype=dtype, device="cpu", kv_memory_gib=2, max_num_seqs=max(streams)
    )
    engine = LLMEngine(config)
    if hasattr(engine, "warm_up"):  # (older trees have none)
        engine.warm_up()
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(16, engine.model_config.vocab_size - 16) for _ in range(n)]

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    engine.generate([ids(512)], params(8))
    cold = [cpu_ms(lambda: engine.generate([ids(2000)], params(1))) for _ in range(6)][1:]
    print(f"{dtype}: cold 2000-token prompt {statistics.median(cold):.1f} ms", flush=True)
    for n in streams:
        for i in range(n):
            engine.add_request(f"{n}-{i}", ids(128), params(64))
        prefill: list[float] = []  # the steps that compute prompt tokens (decode rows beside them included)
        decode: list[float] = []
        while engine.has_work():
            s = engine.scheduler
            prompts_done = not s.waiting and all(q.num_computed >= q.num_prompt_tokens for q in s.running)
            (decode if prompts_done else prefill).append(cpu_ms(engine.step))
        print(
            f"{dtype}: {n} x 128-token prompts: prefill {sum(prefill):.1f} ms in {len(prefill)} step(s); "
            f"decode {statistics.median(decode):.2f} ms a step ({len(decode)} steps)",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--streams", default="16,64", help="decode batch sizes (default: 16,64)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    p.add_argument("--models-dir", type=Path, help="keep (and reuse) the checkpoint here")
    p.add_argument("--kvgate-src", type=Path, help="import the engine from this source tree")
    args = p.parse_args(argv)
    sys.path.insert(0, str(args.kvgate_src or Path(__file__).resolve().parents[2]))
    import torch

    import engine.llm_engine  # noqa: F401  (the engine package is that tree's before build_model imports it)

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.models_dir or Path(tmp), "h256")
        for dtype in args.dtypes.split(","):
            measure(model, dtype, [int(s) for s in args.streams.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
