"""Where a request's time goes in kvgate, piece by piece, on bench_routers' workloads.

    python tests/bench/bench_request_path.py [--trace-requests 300]

1. The overhead bench's chat request (a 1.7 kB system prompt and a short question), through an in-process
   gateway: each step before dispatch timed in a tight loop, as a share of their sum.
2. The Mooncake trace's prompts (bench_routers' texts, one token per byte, no word gaps): what the gateway
   spends per prompt tokenizing, on the rest of preparing it (mostly block hashes) and on the engine's body;
   and the hit rate of bench_routers' 1,500 requests with one engine and an unbounded cache, the most any
   router can reach (engines with bench_routers' capacity evict long before that).
3. One simulated engine (its own process) answering the same trace prompts sent as text (what the Rust
   routers send), as ``prompt_token_ids`` and as ``prompt_token_ids_hex`` (what kvgate sends): the median time
   to the first streamed byte per prompt length, and ids against text as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_overhead import MODEL
from bench_routers import byte_tokenizer_dir, chat_body, start_engines
from trace_workload import TRACE, hit_ceiling, trace_body

from cache.chat_template import render_messages
from cache.tokens import Tokenizer, pack_token_ids
from gateway.app import GATEWAY, build_app
from gateway.config import parse_config
from gateway.demo import stop_engines, wait_healthy
from gateway.http.engine_body import engine_body
from gateway.http.lean_request import LeanRequest
from gateway.http.loop import install_best_loop
from gateway.http.upstream import UpstreamPool
from gateway.prepared import Prepared
from gateway.routing import RouteRequest
from gateway.routing.base import route_key
from gateway.schemas import parse_chat
from gateway.service import Gateway
from region_map.fleet import EngineState
from region_map.simulation.trace import TraceRequest, load_trace


def gateway_for(tokenizer: Path) -> Gateway:
    """A gateway as bench_routers configures it, in front of four engines that report packed ids."""
    engines = [
        {"name": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}", "model": MODEL, "accepts_token_ids": True}
        for i in range(4)
    ]
    config = parse_config({"region": "bench", "regions": [{"name": "bench", "engines": engines}],
                           "gateway": {"tokenizer": str(tokenizer), "access_log": False}})  # fmt: skip
    gateway = build_app(config)[GATEWAY]
    for engine in gateway.fleet:
        engine.healthy, engine.reported_token_ids_hex = True, True
    return gateway


def lean_request(raw: bytes, path: str) -> LeanRequest:
    headers = CIMultiDictProxy(CIMultiDict([("Content-Type", "application/json")]))
    return LeanRequest(None, "POST", path, headers, raw, "127.0.0.1")  # type: ignore[arg-type]  # never answered


def upstream_body(gateway: Gateway, p: Prepared, engine: EngineState) -> bytes:
    """The bytes the engine is sent (gateway.http.engine_body, serialized as the gateway does)."""
    body = engine_body(p, engine, default_block_size=gateway.settings.block_size)
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


async def per_call_us(step: Callable[[], Awaitable[Any]], n: int) -> float:
    for _ in range(min(200, n)):
        await step()
    start = time.perf_counter()
    for _ in range(n):
        await step()
    return (time.perf_counter() - start) / n * 1e6


ROUTE_STEP = "route"


async def chat_pieces(gateway: Gateway, n: int) -> dict[str, float]:
    raw = chat_body(7)
    request = lean_request(raw, "/v1/chat/completions")
    body = orjson.loads(raw)
    prep = gateway.prepare
    text = render_messages(prep.tokenizer, body["messages"])
    p = await prep.chat(request, body)
    engines = gateway.fleet.serving(p.model)
    router = gateway.router
    cached, _ = router.cached_tokens(p, engines)
    candidates = router.candidates(engines, cached, p.home_region)

    def decide_and_take_back() -> None:
        """The whole decision, committed, then released (so that every round starts from the same view)."""
        route = router.decide(router.plan(p))
        assert not isinstance(route, Exception)
        router.release(route)

    route = RouteRequest(prompt_tokens=len(p.token_ids),
                         route_key=route_key(p.tenant, p.session_id, p.hashes, b""), seq=1,
                         home_region=p.home_region)  # fmt: skip

    async def run(f: Callable[[], Any]) -> Any:
        return f()

    steps: dict[str, Callable[[], Awaitable[Any]]] = {
        "read JSON": lambda: prep.read_json(request),
        "validate": lambda: run(lambda: parse_chat(body)),
        "chat template": lambda: run(lambda: render_messages(prep.tokenizer, body["messages"])),
        "tokenize": lambda: run(lambda: prep.tokenizer.encode(text)),
        "block hashes": lambda: run(lambda: prep.block_hashes(p.token_ids, p.model, p.cache_salt)),
        "residency lookup": lambda: run(lambda: gateway.state.lookup(p.hashes)),
        "candidates": lambda: run(lambda: router.candidates(engines, cached, p.home_region)),
        "policy": lambda: run(lambda: gateway.policy.pick(route, candidates)),
        ROUTE_STEP: lambda: run(decide_and_take_back),
        "engine body": lambda: run(lambda: upstream_body(gateway, p, engines[0])),
    }
    return {name: await per_call_us(step, n) for name, step in steps.items()}


async def trace_pieces(gateway: Gateway, trace: list[TraceRequest]) -> dict[str, float]:
    """Mean ms per trace prompt, each prompt seen once in trace order (as the gateway sees them)."""
    prep = gateway.prepare
    totals = {"tokenize": 0.0, "rest of preparing": 0.0, "engine body": 0.0}
    tokens = 0
    engine = gateway.fleet.engines["bench/e0"]
    for r in trace:
        raw = trace_body(r)
        request = lean_request(raw, "/v1/completions")
        body = orjson.loads(raw)
        t0 = time.perf_counter()
        ids = prep.tokenizer.encode(body["prompt"])
        t1 = time.perf_counter()
        p = await prep.completion(request, body)  # tokenizes again: from the tokenizer's cache
        t2 = time.perf_counter()
        upstream_body(gateway, p, engine)
        t3 = time.perf_counter()
        totals["tokenize"] += t1 - t0
        totals["rest of preparing"] += t2 - t1
        totals["engine body"] += t3 - t2
        tokens += len(ids)
    return {"mean prompt tokens": tokens / len(trace)} | {k: v / len(trace) * 1e3 for k, v in totals.items()}


BANDS = ((0, 8_000), (8_000, 32_000), (32_000, 1 << 40))


async def engine_forms(
    tokenizer_dir: Path, tok: Tokenizer, trace: list[TraceRequest], per_band: int
) -> dict[str, dict[str, float]]:
    engines = start_engines(1, tokenizer_dir, prefill_s=0.0, decode_s=0.0, capacity=1 << 22)
    pool = UpstreamPool("127.0.0.1", engines[0].port)
    out: dict[str, dict[str, float]] = {}
    try:
        await wait_healthy(engines)
        for lo, hi in BANDS:
            chosen = [r for r in trace if lo <= r.input_tokens < hi][:per_band]
            if not chosen:
                continue
            times: dict[str, list[float]] = {"text": [], "ids": [], "hex ids": []}
            for i, r in enumerate(chosen):
                body = orjson.loads(trace_body(r))
                ids = tok.encode(body["prompt"])
                forms = {"text": {}, "ids": {"prompt_token_ids": ids.tolist()},
                         "hex ids": {"prompt_token_ids_hex": pack_token_ids(ids)}}  # fmt: skip
                for name, extra in forms.items():
                    # Its own cache salt: every form prefills from nothing.
                    payload = orjson.dumps({**body, **extra, "cache_salt": f"{name}-{lo}-{i}"})
                    start = time.perf_counter()
                    response = await pool.request(
                        "POST", "/v1/completions", payload, [("Content-Type", "application/json")]
                    )
                    await response.next_batch(30)
                    times[name].append(time.perf_counter() - start)
                    await response.read(30)
            band = f"{lo // 1000}k-{hi // 1000}k" if hi < 1 << 40 else f"{lo // 1000}k+"
            out[f"{band} tokens ({len(chosen)})"] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    finally:
        pool.close()
        stop_engines(engines)
    return out


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = byte_tokenizer_dir(Path(tmp) / "tokenizer")
        gateway = gateway_for(tokenizer)
        pieces = await chat_pieces(gateway, args.n)
        whole_route = pieces.pop(ROUTE_STEP)
        total = sum(pieces.values())
        print(f"\n1. the overhead bench's chat request, before dispatch: {total:.1f} us in all (tight loop)")
        for name, us in pieces.items():
            print(f"  {name:18s} {us:7.1f} us  {us / total:5.1%}")
        print(
            f"  the Router's whole decision (lookup, candidates, policy, commit and its release): "
            f"{whole_route:.1f} us"
        )
        trace = load_trace(TRACE, limit=args.trace_requests)
        figures = await trace_pieces(gateway, trace)
        print(f"\n2. the trace's first {len(trace)} prompts in the gateway "
              f"(mean {figures.pop('mean prompt tokens'):.0f} tokens)")  # fmt: skip
        for name, ms in figures.items():
            print(f"  {name:18s} {ms:7.3f} ms per prompt")
        whole = load_trace(TRACE, limit=args.ceiling_requests)
        print(f"  prefix-hit ceiling of the first {len(whole)} requests (one engine, unbounded cache): "
              f"{hit_ceiling(whole):.1%}")  # fmt: skip
        forms = await engine_forms(tokenizer, gateway.prepare.tokenizer, trace, args.per_band)
        print("\n3. one simulated engine, zero-cost: median time to first byte by how the prompt is sent")
        for band, t in forms.items():
            text, ids, hex_ids = t["text"], t["ids"], t["hex ids"]
            print(f"  {band:24s} text {text:6.2f} ms  ids {ids:6.2f} ms  hex ids {hex_ids:6.2f} ms"
                  f"  ids/text {ids / text:.2f}  hex/text {hex_ids / text:.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=5000, help="tight-loop calls per step in part 1")
    parser.add_argument("--trace-requests", type=int, default=300, help="the first N requests of the trace")
    parser.add_argument(
        "--ceiling-requests",
        type=int,
        default=1500,
        help="requests for the hit-rate ceiling (bench_routers')",
    )
    parser.add_argument("--per-band", type=int, default=30, help="prompts per length band in part 3")
    args = parser.parse_args()
    install_best_loop()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
