"""kvgate in front of two REAL vLLM 0.32.0 engines (CPU build): hit rate and TTFT against round robin and
against one engine, on the same requests; and how stale the residency index is after an engine restart.

    KVGATE_VLLM_BENCH=1 scripts/test-vllm          (starts the engines, then runs this with their addresses)

Workload (seeded, the same for every configuration): 24 conversations of 5 turns each (every turn resends
the history, with ``x-session-affinity``) and 6 long shared documents with 8 questions each (no header),
interleaved at random, sent by 4 concurrent clients, streamed (TTFT = first content chunk), 168 requests.
Configurations, each from empty engine caches (``/reset_prefix_cache`` before every run), rounds interleaved:

- ``kvgate``: the default policy with the engines' ZMQ KV events;
- ``round_robin``: kvgate's round-robin policy (the cache-blind baseline);
- ``one engine``: kvgate in front of engine 0 alone (every prefix is cached on the one engine that runs
  everything: the hit-rate ceiling, at half the fleet's capacity).

Hit rate = cached prompt tokens / prompt tokens, as vLLM reports them. Staleness: warm both engines, restart
one, send the warm prompts again, and count the requests whose predicted cached tokens differ from vLLM's:
with events (kvgate) against without them (the gateway's own routing records, ``kv_events = false``).

On these machines the engines are a 1-layer model on 2 shared cores: a cached prefix saves little compute, so
TTFT differences are small and noisy here; on a GPU serving an 8B model, a 1,000-token uncached prefill costs
~50-100 ms against a few ms cached, and the hit-rate difference becomes TTFT directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.integration.conftest import (
    VllmFleet,
    fleet_from_env,
    gateway_in_front,
    settled,
    until,
)

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo"]
ROUNDS = int(os.environ.get("KVGATE_BENCH_ROUNDS", "3"))
CLIENTS = 4


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Request:
    path: str
    body: dict[str, Any]
    session: str | None = None


def workload(seed: int = 1) -> list[list[Request]]:
    """Streams of requests, one stream per conversation or document (order within a stream is kept)."""
    streams: list[list[Request]] = []
    for conv in range(24):
        history = [{"role": "system", "content": text(100 + conv, 80)}]
        turns = []
        for t in range(5):
            history = [*history, {"role": "user", "content": text(1000 * conv + t, 30)}]
            turns.append(Request("/v1/chat/completions", {"messages": list(history)}, f"conv-{conv}"))
            history = [*history, {"role": "assistant", "content": text(2000 * conv + t, 15)}]
        streams.append(turns)
    for doc in range(6):
        system = text(5000 + doc, 250)
        streams.append([Request("/v1/completions", {"prompt": f"{system}\nQuestion {q}: {text(q, 8)}"})
                        for q in range(8)])  # fmt: skip
    random.Random(seed).shuffle(streams)
    return streams


@dataclass
class Outcome:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    mispredicted: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


async def send(session: aiohttp.ClientSession, url: str, model: str, r: Request, out: Outcome) -> None:
    body = {
        "model": model,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        **r.body,
    }
    headers = {"x-session-affinity": r.session} if r.session else {}
    started = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] | None = None
    async with session.post(url + r.path, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        predicted = int(resp.headers.get("x-kvgate-predicted-cached-tokens", "-1"))
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert usage is not None and first is not None
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    out.prompt_tokens += usage["prompt_tokens"]
    out.cached_tokens += cached
    out.ttfts.append(first)
    out.requests += 1
    out.mispredicted += predicted != cached


async def run(url: str, model: str, streams: list[list[Request]]) -> Outcome:
    out = Outcome()
    queue = list(streams)

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            for r in queue.pop():
                await send(session, url, model, r, out)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(CLIENTS)))
    return out


async def reset(fleet: VllmFleet) -> None:
    async with aiohttp.ClientSession() as session:
        for url in fleet.urls:
            for _ in range(50):  # refused while requests hold blocks: retry briefly
                async with session.post(url + "/reset_prefix_cache") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def routing(fleet: VllmFleet) -> None:
    streams = workload()
    print(f"{sum(map(len, streams))} requests, {CLIENTS} clients, {ROUNDS} interleaved rounds")
    configs: dict[str, dict[str, Any]] = {
        "kvgate": {},
        "round_robin": {"routing": {"policy": "round_robin"}},
        "one engine": {"engines": 1},
    }
    results: dict[str, list[Outcome]] = {name: [] for name in configs}
    for round_ in range(ROUNDS):
        for name in random.Random(round_).sample(list(configs), len(configs)):
            options = dict(configs[name])
            n = options.pop("engines", 2)
            subset = dataclasses.replace(
                fleet, urls=fleet.urls[:n], kv_events=fleet.kv_events[:n], kv_replay=fleet.kv_replay[:n]
            )
            await reset(fleet)
            async with gateway_in_front(subset, **options) as (url, gateway):
                await until(lambda g=gateway: all(e.healthy for e in g.fleet), 60, "engines healthy")
                await until(
                    lambda g=gateway: all(f.ready.is_set() for f in g.metrics.event_followers), 30, "events"
                )
                await settled(gateway)
                results[name].append(await run(url, fleet.model, streams))
    print(
        f"{'configuration':14} {'hit rate (runs)':28} {'TTFT p50 ms':>12} {'p90 ms':>8} {'mispredicted':>13}"
    )
    for name, outs in results.items():
        rates = [o.hit_rate for o in outs]
        ttfts = [t for o in outs for t in o.ttfts]
        print(f"{name:14} {statistics.median(rates):6.1%} ({', '.join(f'{r:.1%}' for r in rates):18}) "
              f"{pct(ttfts, 0.5) * 1e3:12.1f} {pct(ttfts, 0.9) * 1e3:8.1f} "
              f"{sum(o.mispredicted for o in outs):6d}/{sum(o.requests for o in outs)}")  # fmt: skip
    ours = statistics.median(o.hit_rate for o in results["kvgate"])
    base = statistics.median(o.hit_rate for o in results["round_robin"])
    print(f"kvgate / round_robin hit rate: {ours / base:.2f}x")


async def staleness(fleet: VllmFleet) -> None:
    """Warm both engines, restart engine 0, resend: count the wrong predictions, with events and without."""
    if fleet.restart is None:
        print("staleness: no restart script, skipped")
        return
    streams = workload(seed=2)[:10]
    for label, settings in (("with KV events", {}), ("without (routing records)", {"events": False})):
        await reset(fleet)
        subset = (
            fleet if settings.get("events", True) else dataclasses.replace(fleet, kv_events=[], kv_replay=[])
        )
        async with gateway_in_front(subset) as (url, gateway):
            await until(lambda g=gateway: all(e.healthy for e in g.fleet), 60, "engines healthy")
            await run(url, fleet.model, streams)  # warm
            await settled(gateway)
            restart = await asyncio.create_subprocess_exec(str(fleet.restart), "0")
            assert await restart.wait() == 0
            await until(lambda g=gateway: all(e.healthy for e in g.fleet), 120, "restarted engine healthy")
            await asyncio.sleep(12)  # past the event follower's 10 s idle probe
            again = Outcome()
            async with aiohttp.ClientSession() as session:
                for stream in streams:
                    for r in stream:
                        await send(session, url, fleet.model, r, again)
            print(f"after a restart, {label:26}: {again.mispredicted}/{again.requests} requests mispredicted")


async def main() -> None:
    fleet = fleet_from_env()
    if fleet is None:
        sys.exit("run through scripts/test-vllm (KVGATE_VLLM_BENCH=1): it starts the engines")
    await routing(fleet)
    await staleness(fleet)


if __name__ == "__main__":
    asyncio.run(main())
