"""The Mooncake conversation trace as the benchmarks replay it: prompts built from its block ids, a replay
against one router that measures hit rate and TTFT, and what any router could reach on it.

Every hash id becomes the same 512-token text wherever it occurs (512 ASCII bytes, one token each with the
benches' byte tokenizer), so prompts share prefixes exactly as in the trace.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from bench_gateway_overhead import MODEL, pct
from tqdm import tqdm

from gateway.upstream import UpstreamPool
from region_map.trace import TRACE_BLOCK_TOKENS, TraceRequest

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_trace.jsonl.gz"


def block_text(block_id: int) -> str:
    """The same 512 ASCII bytes (= 512 tokens) for the same block id, anywhere in any prompt."""
    seed = f"<{block_id:x}>"
    return (seed * (TRACE_BLOCK_TOKENS // len(seed) + 1))[:TRACE_BLOCK_TOKENS]


def trace_body(r: TraceRequest) -> bytes:
    full, tail = divmod(r.input_tokens, TRACE_BLOCK_TOKENS)
    text = "".join(block_text(b) for b in r.blocks[:full])
    if tail and len(r.blocks) > full:
        text += block_text(r.blocks[full])[:tail]
    body = {"model": MODEL, "prompt": text, "max_tokens": max(1, min(r.output_tokens, 8)), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    return orjson.dumps(body)


async def replay(port: int, trace: list[TraceRequest], speedup: float) -> dict[str, Any]:
    pool = UpstreamPool("127.0.0.1", port, max_idle=256)
    ttft: list[float] = []
    per_request: list[tuple[float, int] | None] = [None] * len(trace)  # (TTFT, cached tokens) by index
    prompt = cached = errors = 0
    t0 = time.perf_counter()
    bar = tqdm(total=len(trace), desc=f"trace :{port}", file=sys.stderr, leave=False)

    async def send(i: int, r: TraceRequest) -> None:
        nonlocal prompt, cached, errors
        await asyncio.sleep(max(0.0, r.arrival_s / speedup - (time.perf_counter() - t0)))
        start = time.perf_counter()
        try:
            headers = [("Content-Type", "application/json"), ("x-session-affinity", str(r.conversation))]
            resp = await pool.request("POST", "/v1/completions", trace_body(r), headers, header_timeout=120)
            first = await resp.next_batch(120)
            elapsed = time.perf_counter() - start
            ttft.append(elapsed)
            data = (first or b"") + await resp.read(120)
            usage = None
            for line in data.split(b"\n"):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    chunk = orjson.loads(line[6:])
                    usage = chunk.get("usage") or usage
            if resp.status != 200 or usage is None:
                raise RuntimeError(f"HTTP {resp.status}")
            prompt += usage["prompt_tokens"]
            hit = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            cached += hit
            per_request[i] = (elapsed, hit)
        except Exception:
            errors += 1
        bar.update()

    await asyncio.gather(*(send(i, r) for i, r in enumerate(trace)))
    bar.close()
    pool.close()
    hit_rate = cached / prompt if prompt else 0.0
    return {
        "hit_rate": hit_rate,
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p90_s": pct(ttft, 0.9),
        "errors": errors,
        "per_request": per_request,
    }


def paired_with(
    mine: list[tuple[float, int] | None], theirs: list[tuple[float, int] | None]
) -> dict[str, float]:
    """kvgate's TTFT minus another router's, request by request, over the requests both answered with the
    same cached tokens: what separates them there is each one's own overhead (and the machine's noise), not
    where they sent the request."""
    same = [a[0] - b[0] for a, b in zip(mine, theirs, strict=True) if a and b and a[1] == b[1]]
    if not same:
        return {}
    return {"same_cached_share": len(same) / len(mine), "paired_p10_ms": pct(same, 0.1) * 1e3,
            "paired_p50_ms": pct(same, 0.5) * 1e3, "paired_p90_ms": pct(same, 0.9) * 1e3}  # fmt: skip


def hit_ceiling(trace: list[TraceRequest]) -> float:
    """Prompt tokens a single engine with an unbounded cache would find cached (full blocks of a prefix)."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace:
        held = 0
        for block in r.blocks[: r.input_tokens // TRACE_BLOCK_TOKENS]:
            if block not in seen:
                break
            held += 1
        hit += held * TRACE_BLOCK_TOKENS
        total += r.input_tokens
        seen.update(r.blocks)
    return hit / total
