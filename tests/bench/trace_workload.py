"""The Mooncake conversation trace as the benchmarks replay it: prompts built from its block ids, a replay
against one router that measures hit rate and TTFT, and what any router could reach on it.

Every hash id becomes the same 512-token text wherever it occurs (512 ASCII bytes, one token each with the
benches' byte tokenizer), so prompts share prefixes exactly as in the trace. By default that text is one
unbroken run of characters; with ``words=True`` it is words of letters separated by spaces, as prompts are,
for a tokenizer that splits words apart first (``byte_tokenizer_dir(..., split_words=True)``).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import orjson
from bench_gateway_overhead import MODEL, pct
from tqdm import tqdm

from gateway.demo import EngineProcess
from gateway.http.upstream import UpstreamPool
from region_map.simulation.trace import TRACE_BLOCK_TOKENS, TraceRequest

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_trace.jsonl.gz"


_LETTERS = str.maketrans("0123456789abcdef", "abcdefghijklmnop")


def block_text(block_id: int, *, words: bool = False) -> str:
    """The same 512 ASCII bytes (= 512 tokens) for the same block id, anywhere in any prompt: ``<1f3>`` over
    and over, or with ``words`` the word ``kbpd`` (the id's hex digits as letters) and a space."""
    seed = f"k{block_id:x} ".translate(_LETTERS) if words else f"<{block_id:x}>"
    return (seed * (TRACE_BLOCK_TOKENS // len(seed) + 1))[:TRACE_BLOCK_TOKENS]


def trace_body(r: TraceRequest, *, words: bool = False) -> bytes:
    full, tail = divmod(r.input_tokens, TRACE_BLOCK_TOKENS)
    text = "".join(block_text(b, words=words) for b in r.blocks[:full])
    if tail and len(r.blocks) > full:
        text += block_text(r.blocks[full], words=words)[:tail]
    body = {"model": MODEL, "prompt": text, "max_tokens": max(1, min(r.output_tokens, 8)), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    return orjson.dumps(body)


async def replay(
    port: int, trace: list[TraceRequest], speedup: float, *, words: bool = False
) -> dict[str, Any]:
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
            resp = await pool.request("POST", "/v1/completions", trace_body(r, words=words), headers,
                                      header_timeout=120)  # fmt: skip
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


def prompt_block_keys(r: TraceRequest, block_tokens: int) -> list[int]:
    """Chained keys of the whole ``block_tokens``-token blocks of ``r``'s prompt as replayed (``trace_body``:
    a trace block is the same 512 tokens wherever it appears, and a prompt's last block is cut at its
    length): two prompts share a key exactly when they share every token up to the end of that block."""
    full, tail = divmod(r.input_tokens, TRACE_BLOCK_TOKENS)
    spans = [(b, TRACE_BLOCK_TOKENS) for b in r.blocks[:full]]
    if tail and len(r.blocks) > full:
        spans.append((r.blocks[full], tail))
    keys: list[int] = []
    chain, filled = 0, 0
    piece: list[tuple[int, int, int]] = []
    for block, length in spans:
        offset = 0
        while offset < length:
            take = min(block_tokens - filled, length - offset)
            piece.append((block, offset, take))
            filled, offset = filled + take, offset + take
            if filled == block_tokens:
                chain = hash((chain, tuple(piece)))
                keys.append(chain)
                piece, filled = [], 0
    return keys


def lru_hit_rate(
    trace: list[TraceRequest], block_tokens: int = TRACE_BLOCK_TOKENS, capacity_blocks: int | None = None
) -> float:
    """Prompt tokens one engine with a cache of ``capacity_blocks`` blocks of ``block_tokens`` tokens
    (unbounded with None) would find cached, each prompt computed before the next arrives: for each prompt
    as replayed, the longest prefix it shares with the cache, in whole blocks, less its last token (which
    every engine computes: its logits start the decode). A bounded cache evicts least recently used first,
    a prompt's last block before its first, as vLLM's and the simulated engine's do.

    Unbounded, it is the ceiling: no router in front of engines with bounded caches can do better. Bounded
    by the caches of all the engines together, it is what they would find if they pooled their caches as one
    (and lost nothing to copies held twice): a router that keeps every prefix in one place, or pulls it
    from there, comes near it."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in trace:
        keys = prompt_block_keys(r, block_tokens)
        shared = 0
        for key in keys:
            if key not in lru:
                break
            shared += block_tokens
        usable = min(shared, r.input_tokens - 1)
        hit += usable - usable % block_tokens
        total += r.input_tokens
        for key in reversed(keys):  # its first block ends up the most recently used
            lru[key] = None
            lru.move_to_end(key)
        while capacity_blocks is not None and len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit / total


def hit_ceiling(trace: list[TraceRequest], block_tokens: int = TRACE_BLOCK_TOKENS) -> float:
    """What one engine with an unbounded cache would find (``lru_hit_rate``)."""
    return lru_hit_rate(trace, block_tokens)


# -- what the routers' figures are read from ----------------------------------------------------------


async def scrape(port: int, *names: str) -> list[float]:
    """Each named series from the /metrics at ``port``, summed over its label sets."""
    pool = UpstreamPool("127.0.0.1", port)
    r = await pool.request("GET", "/metrics")
    text = (await r.read(10)).decode()
    pool.close()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name in names:
            totals[name] = totals.get(name, 0.0) + float(value)
    return [totals[name] for name in names]  # a series it does not export is a KeyError


async def served_prompts(port: int) -> list[int]:
    """The prompts a simulated engine was sent, in arrival order (``engine.sim.server.prompt_key``)."""
    pool = UpstreamPool("127.0.0.1", port)
    r = await pool.request("GET", "/debug/served")
    prompts: list[int] = orjson.loads(await r.read(10))["prompts"]
    pool.close()
    return prompts


def placements(prompt_keys: list[int], served: list[list[int]]) -> list[int]:
    """Which engine (its index in ``served``, each engine's ``served_prompts``) each prompt of a replay went
    to, in the replay's order; -1 for one no engine was sent. A prompt sent twice takes its engines in the
    order of the engines' lists (the replay cannot tell two equal prompts apart)."""
    where: dict[int, list[int]] = {}
    for engine, keys in enumerate(served):
        for key in keys:
            where.setdefault(key, []).append(engine)
    return [where[key].pop(0) if where.get(key) else -1 for key in prompt_keys]


def same_placements(a: list[int], b: list[int]) -> float:
    """The share of the requests placed in both replays that went to the same engine both times."""
    both = [(x, y) for x, y in zip(a, b, strict=True) if x >= 0 and y >= 0]
    return sum(x == y for x, y in both) / len(both) if both else float("nan")


async def engine_counts(engines: list[EngineProcess]) -> list[float]:
    return [(await scrape(e.port, "kvgate_engine_requests_finished_total"))[0] for e in engines]


# kvgate's receive-to-dispatch time (parse, tokenize, hash, route): seconds in all, and requests.
OVERHEAD_SERIES = ("kvgate_routing_overhead_seconds_sum", "kvgate_routing_overhead_seconds_count")


async def overhead_mean_ms(port: int) -> float:
    """kvgate's mean receive-to-dispatch time, from its /metrics (one worker's, when it runs several)."""
    total, count = await scrape(port, *OVERHEAD_SERIES)
    return total / count * 1e3 if count else 0.0


# -- one prompt at a time, by length -------------------------------------------------------------------------

LENGTHS = (2048, 14336, 40960)  # prompt tokens: short, the trace's mean, its long tail


async def by_length(
    ports: dict[str, int], repeats: int, *, words: bool = False
) -> dict[str, dict[int, float]]:
    """Median time to the first streamed byte of a new prompt (its blocks cached nowhere) of each of
    ``LENGTHS``, one request at a time through every path in turn, in a new order each time: what each
    router costs a prompt of that length with nothing else running. When ``kvgate`` is among the paths,
    also its mean receive-to-dispatch time per length (key ``kvgate dispatch``)."""
    pools = {name: UpstreamPool("127.0.0.1", port) for name, port in ports.items()}
    kvgate = ports.get("kvgate")
    out: dict[str, dict[int, float]] = {name: {} for name in pools}
    if kvgate is not None:
        out["kvgate dispatch"] = {}
    order, shuffle = list(pools), random.Random(0).shuffle
    block = 1 << 40  # ids the trace never uses, a new one for every block of every request
    for tokens in LENGTHS:
        ttfb: dict[str, list[float]] = {name: [] for name in pools}
        before = await scrape(kvgate, *OVERHEAD_SERIES) if kvgate is not None else None
        for _ in range(repeats):
            shuffle(order)
            for name in order:
                blocks = range(block, block + tokens // TRACE_BLOCK_TOKENS)
                block = blocks.stop
                text = "".join(block_text(b, words=words) for b in blocks)
                body = orjson.dumps({"model": MODEL, "prompt": text, "max_tokens": 1, "stream": True})
                start = time.perf_counter()
                response = await pools[name].request(
                    "POST", "/v1/completions", body, [("Content-Type", "application/json")], header_timeout=60
                )
                await response.next_batch(60)
                ttfb[name].append(time.perf_counter() - start)
                rest = await response.read(60)
                if response.status != 200:
                    raise RuntimeError(f"{name}: HTTP {response.status} for {tokens} tokens: {rest[:200]!r}")
        for name, values in ttfb.items():
            out[name][tokens] = statistics.median(values)
        if kvgate is not None and before is not None:
            after = await scrape(kvgate, *OVERHEAD_SERIES)
            total, count = (a - b for a, b in zip(after, before, strict=True))
            out["kvgate dispatch"][tokens] = total / count if count else float("nan")
    for pool in pools.values():
        pool.close()
    return out
