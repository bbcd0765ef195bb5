"""A KV pull against recomputing, on kvgate's engine: a random 88M-parameter Llama ("small", fp32) on CPU.

    python tests/bench/bench_kv_pull.py [--model DIR] [--prompt 1024] [--rounds 5] [--json]

Two ``both`` engines (``--threads 1``, ``taskset`` to cores 0 and 1). Every round the source (core 0)
computes a fresh prompt of ``--prompt`` tokens, then the target (core 1) answers that prompt plus 16 new
tokens twice, alternating which comes first:

- pull: ``kv_transfer_params.pull_url`` names the source; the target fetches the prompt's cached K/V from
  ``POST /v1/kv/cached`` and computes only the 16 new tokens (and the last partial block);
- recompute: a fresh prompt of the same length (a cold cache: no shared block) computed on the target.

Time to first token of each (streaming, max_tokens 2), medians, and the ratio pull / recompute. The pulled
tokens' share of the pull's time against their share of the recompute gives the per-token cost ratio that
``kv_pull_s_per_token`` / ``prefill_s_per_token`` stand for in the gateway's estimate (0.24 by default;
on a GPU with a fast fabric the bytes move far faster than here, over loopback HTTP from a CPU engine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pd import (
    MODEL_NAME,
    Stream,
    make_prompt,
    progress,
    small_model,
    start_engine,
    stop_engines,
    stream_completion,
    wait_healthy,
)

from engine.model.config import ModelConfig

NEW_TOKENS = 16  # the turn's new text after the pulled prefix


def body(prompt: list[int], pull_from: str | None = None) -> bytes:
    request: dict[str, Any] = {"model": MODEL_NAME, "prompt": "x", "prompt_token_ids": prompt,
                               "max_tokens": 2, "temperature": 0, "stream": True}  # fmt: skip
    if pull_from is not None:
        request["kv_transfer_params"] = {"pull_url": pull_from, "pull_tokens": len(prompt) - NEW_TOKENS}
    return orjson.dumps(request)


async def first_token_s(session: aiohttp.ClientSession, url: str, payload: bytes) -> tuple[float, Stream]:
    start = time.perf_counter()
    s = await asyncio.wait_for(stream_completion(session, url, payload, Stream(start)), 300)
    first = s.chunks[0] if s.chunks else s.first_data
    assert first is not None
    return first - start, s


async def run(model: str, prompt_len: int, rounds: int, logdir: Path) -> dict[str, Any]:
    vocab = ModelConfig.from_dir(Path(model)).vocab_size
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        source = start_engine(model, "source", "both", 0, logdir)
        target = start_engine(model, "target", "both", 1, logdir)
        try:
            await wait_healthy(session, [source, target], 180)
            for e in (source, target):  # first steps allocate and warm up
                await first_token_s(session, e.url, body(make_prompt(5 + e.core, 64, vocab)))
            pulled: list[float] = []
            recomputed: list[float] = []
            tokens = 0
            for r in range(rounds):
                prefix = make_prompt(100 + 3 * r, prompt_len, vocab)
                await first_token_s(session, source.url, body(prefix))  # the source now holds it
                turn = prefix + make_prompt(101 + 3 * r, NEW_TOKENS, vocab)
                cold = make_prompt(102 + 3 * r, prompt_len + NEW_TOKENS, vocab)
                runs = [("pull", turn, source.url), ("recompute", cold, None)]
                for label, prompt, pull_from in runs if r % 2 == 0 else runs[::-1]:
                    seconds, s = await first_token_s(session, target.url, body(prompt, pull_from))
                    if label == "pull":
                        if s.transfer != "pull" or s.transferred == 0:
                            raise RuntimeError(f"the target did not pull (transferred {s.transferred})")
                        tokens = s.transferred
                        pulled.append(seconds)
                    else:
                        recomputed.append(seconds)
                progress(f"round {r + 1}/{rounds}: pull {pulled[-1] * 1e3:.0f} ms, "
                         f"recompute {recomputed[-1] * 1e3:.0f} ms")  # fmt: skip
        finally:
            stop_engines([source, target])
    pull_s, recompute_s = statistics.median(pulled), statistics.median(recomputed)
    total = prompt_len + NEW_TOKENS
    # Per token: the pull's time over what it pulled, against the recompute's time over every token (the
    # tokens the pull left to compute cost about that much each, so they are taken out of the pull first).
    computed_after_pull = total - tokens
    recompute_per_token = recompute_s / total
    pull_per_token = max(0.0, pull_s - computed_after_pull * recompute_per_token) / tokens
    return {"prompt_tokens": total, "pulled_tokens": tokens, "rounds": rounds, "pull_s": pull_s,
            "recompute_s": recompute_s, "ratio": pull_s / recompute_s,
            "per_token_ratio": pull_per_token / recompute_per_token,
            "pull_all_s": pulled, "recompute_all_s": recomputed}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model directory (default: a 'small' random model in a temp dir)")
    parser.add_argument("--prompt", type=int, default=1024, help="tokens the target pulls (default 1024)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if shutil.which("taskset") is None:
        parser.error("needs the taskset command")
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-pull-") as tmp:
        model = args.model or small_model(Path(tmp))
        r = asyncio.run(run(model, args.prompt, args.rounds, Path(tmp)))
    print(
        f"{r['prompt_tokens']}-token prompt, {r['pulled_tokens']} tokens pulled, median of {r['rounds']}:\n"
        f"  TTFT pull {r['pull_s'] * 1e3:.0f} ms, recompute {r['recompute_s'] * 1e3:.0f} ms -> ratio "
        f"{r['ratio']:.3f}\n  per pulled token: {r['per_token_ratio']:.3f} x the cost of computing it"
    )
    if args.json:
        print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
