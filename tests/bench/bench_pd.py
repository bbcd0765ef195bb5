"""Prefill/decode disaggregation on kvgate's engine: a random 88M-parameter Llama ("small", fp32) on CPU.

    python tests/bench/bench_pd.py [--model DIR] [--json]

Engine processes (``python -m engine engine``, ``--threads 1``, each pinned to one core with ``taskset``)
are started once and reused: a colocated ``both`` engine on core 0, a ``prefill`` engine on core 0 and a
``decode`` engine on core 1. Every figure is a ratio against a baseline measured in the same run:

1. KV transfer throughput: the prefill engine's prefix cache holds a 2,048-token prompt; this process
   (pinned to core 1) pulls positions 0..2046 of it with ``KvImporter`` into its own ``KVCache`` via
   ``POST /v1/kv/prefill`` (the prefill engine recomputes only the last partial block), GB/s = payload
   bytes / wall time. Baseline: ``torch`` copy of the same number of bytes in this process. A control, the
   same pull for the last position only (the same recompute, one position sent), separates the prefill
   engine's per-request cost from the cost of the bytes. All three alternate; medians.
2. Time to first token of a 2,048-token prompt, streaming, cold caches (a fresh prompt every time):
   the colocated engine (one process) vs the decode engine pulling the K/V from the prefill engine
   (two processes). Alternated A B A B, medians, ratio P/D / colocated.
3. Inter-token latency of running decodes while long prompts keep arriving: one colocated engine on one
   core vs a P/D pair on two cores. K streaming decodes with short prompts run all the time (restarted when
   they finish); a long prompt arrives every few seconds (max_tokens 1) at the colocated engine, or at the
   decode engine with ``kv_transfer_params`` pointing at the prefill engine. ITL = client-side gaps between
   consecutive content chunks of one stream (its first chunk excluded). Rounds alternate A B A B; p50, p90,
   p99 of the pooled gaps, and the ratio of the p99s (P/D / colocated). The P/D pair has twice the cores.
   Defaults: 4 streams (32-token prompts, max_tokens 512), a 512-token prompt every 4 s, 2 rounds x 20 s
   per setup. 512 tokens because its prefill takes about 2 s on one core here (a 2k prompt takes about
   9 s): long enough to stall a colocated decode visibly, short enough that the colocated engine keeps up
   (prefilling about half the time) and that ten of them fit in 40 s.

Everything runs on 127.0.0.1, bounded in time (about 4 minutes with the defaults); engines are stopped
(SIGTERM, then kill) on every exit path. Progress goes to stderr, the figures to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import torch
from tqdm import tqdm

from engine.attention import KVCache
from engine.engine_types import ImportTicket
from engine.kv_import import KvImporter
from engine.make_model import count_parameters
from engine.model.config import ModelConfig
from engine.sequence import CacheNamespace
from gateway.demo import free_port

MODEL_NAME = "kvgate-pd-bench"
BLOCK_SIZE = 16
KV_BLOCKS = 512  # per engine: a 2k prompt needs 129 blocks; workload 3 about 200
LONG_PROMPT = 2048  # workloads 1 and 2
FIRST_TOKEN = 3  # prompts use ids from here on: 0-2 are the tokenizer's specials (2 is EOS)
T0 = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def make_prompt(seed: int, length: int, vocab: int) -> list[int]:
    """Random token ids: a different seed shares no prefix block with any other prompt (a cold cache)."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(length)]


def small_model(directory: Path) -> str:
    """Write the 'small' random model (88M parameters) under ``directory``; returns its path."""
    model = str(directory / "small-llama")
    progress("writing the 'small' random model")
    subprocess.run(
        [sys.executable, "-m", "engine", "make-model", model, "--preset", "small"], check=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return model


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- engine processes --------------------------------------------------------------------------------------


@dataclass
class Engine:
    name: str
    role: str
    core: int
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""


def start_engine(model: str, name: str, role: str, core: int, logdir: Path) -> Engine:
    port = free_port()
    log = logdir / f"{name}.log"
    cmd = [
        "taskset", "-c", str(core), sys.executable, "-m", "engine", "engine", "--model", model,
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--role", role,
        "--threads", "1", "--kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK_SIZE),
        "--dtype", "float32", "--device", "cpu", "--engine-id", f"bench/{name}",
        "--max-batched-tokens", "2048",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    return Engine(name, role, core, port, process, log)


async def wait_healthy(session: aiohttp.ClientSession, engines: list[Engine], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for e in engines:
        while True:
            if e.process.poll() is not None:
                raise RuntimeError(f"engine {e.name} exited ({e.process.returncode}):\n{e.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with session.get(f"{e.url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {e.name} not healthy after {timeout_s:.0f}s:\n{e.log_tail()}")
            await asyncio.sleep(0.2)


def stop_engines(engines: list[Engine], timeout_s: float = 10.0) -> None:
    for e in engines:
        if e.process.poll() is None:
            e.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for e in engines:
        try:
            e.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            progress(f"engine {e.name} ignored SIGTERM for {timeout_s:.0f}s: killing it")
            e.process.kill()
            e.process.wait()


async def settle(session: aiohttp.ClientSession, engines: list[Engine], vocab: int, seed: int) -> None:
    """Let the work of cancelled requests drain before the next measurement: a 1-token request queues
    behind the step in progress, and the engine applies the aborts its clients left before its next step.
    (``/health``'s load cannot tell: it is refreshed only after a step, so it keeps counting aborted
    requests while the engine idles.)"""
    await asyncio.gather(
        *(
            stream_completion(
                session, e.url, completion_body(make_prompt(seed + i, 16, vocab), 1), Stream(0.0)
            )
            for i, e in enumerate(engines)
        )
    )


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """This process (all its threads) on ``cores`` for a while."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# -- requests ------------------------------------------------------------------------------------------------


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each SSE chunk carrying text
    first_data: float | None = None  # the first data chunk of any kind
    done: float | None = None  # [DONE] arrived
    transfer: str = ""  # x-kvgate-kv-transfer
    transferred: int = 0  # x-kvgate-kv-transferred-tokens


def completion_body(prompt: list[int], max_tokens: int, prefill_url: str | None = None) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "x",
        "prompt_token_ids": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if prefill_url is not None:
        body["kv_transfer_params"] = {"prefill_url": prefill_url}
    return orjson.dumps(body)


async def stream_completion(session: aiohttp.ClientSession, url: str, body: bytes, out: Stream) -> Stream:
    """POST a streaming completion, filling ``out`` as chunks arrive (so a cancelled one keeps its part)."""
    headers = {"Content-Type": "application/json"}
    async with session.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
        out.transfer = resp.headers.get("x-kvgate-kv-transfer", "")
        out.transferred = int(resp.headers.get("x-kvgate-kv-transferred-tokens", "0"))
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            if out.first_data is None:
                out.first_data = now
            payload = line[6:].strip()
            if payload == b"[DONE]":
                out.done = now
                break
            chunk = orjson.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"{url} failed mid-stream: {chunk['error']}")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                out.chunks.append(now)
    return out


# -- 1. transfer throughput ----------------------------------------------------------------------------------


async def bench_transfer(
    session: aiohttp.ClientSession, prefill: Engine, mc: ModelConfig, pulls: int
) -> dict[str, Any]:
    prompt = make_prompt(1, LONG_PROMPT, mc.vocab_size)
    # A normal completion puts every full block of the prompt into the prefill engine's prefix cache.
    await stream_completion(session, prefill.url, completion_body(prompt, 1), Stream(time.perf_counter()))
    blocks = -(-LONG_PROMPT // BLOCK_SIZE) + 1
    cache = KVCache(
        mc.num_hidden_layers, blocks, BLOCK_SIZE, mc.num_key_value_heads, mc.head_dim, torch.float32
    )
    importer = KvImporter(cache, MODEL_NAME, timeout_s=120)
    # A decode engine pulls every position but its prompt's last: a (LONG_PROMPT + 1)-token prompt pulls
    # LONG_PROMPT positions, whole blocks the prefill engine has cached, so the pull is pure transfer.
    end = LONG_PROMPT
    per_position = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4  # K and V, fp32
    nbytes = end * per_position
    src = torch.rand(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    times: dict[str, list[float]] = {"pull": [], "control": [], "copy": []}
    cached = 0

    async def pull(name: str, start: int) -> float:
        nonlocal cached
        ticket = ImportTicket(
            f"bench-{name}-{len(times[name])}", [*prompt, 1], start, end, list(range(blocks))
        )
        before = importer.bytes_received
        t = time.perf_counter()
        cached = await importer(ticket, prefill.url, CacheNamespace())
        elapsed = time.perf_counter() - t
        if importer.bytes_received - before != (end - start) * per_position:
            raise RuntimeError(f"pulled {importer.bytes_received - before} bytes from position {start}")
        return elapsed

    try:
        with pinned({1}):  # the prefill engine is on core 0; the receiver gets core 1, as a decode engine
            for i in range(pulls + 1):  # round 0 warms up the connection and the allocations
                full = await pull("pull", 0)
                # The control: the same request for the last position only: the per-request cost of a
                # pull (HTTP, prefix match, one frame per layer) without the bulk of the bytes.
                control = await pull("control", end - 1)
                t = time.perf_counter()
                dst.copy_(src)
                copy = time.perf_counter() - t
                if i:
                    times["pull"].append(full)
                    times["control"].append(control)
                    times["copy"].append(copy)
    finally:
        await importer.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    net = med["pull"] - med["control"]
    return {
        "positions": end,
        "payload_bytes": nbytes,
        "pulls": pulls,
        "prefill_cached_tokens": cached,
        "pull_s": med["pull"],
        "pull_gb_s": nbytes / med["pull"] / 1e9,
        "control_s": med["control"],
        "net_gb_s": nbytes / net / 1e9 if net > 0 else None,
        "copy_s": med["copy"],
        "copy_gb_s": nbytes / med["copy"] / 1e9,
        "ratio": med["copy"] / med["pull"],
        "net_ratio": med["copy"] / net if net > 0 else None,
    }


# -- 2. time to first token ----------------------------------------------------------------------------------


async def ttft(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, bool, Stream]:
    """Seconds to the first chunk with text (or, if no chunk had text, the first data chunk)."""
    start = time.perf_counter()
    s = await asyncio.wait_for(stream_completion(session, url, body, Stream(start)), 120)
    if s.chunks:
        return s.chunks[0] - start, False, s
    assert s.first_data is not None
    return s.first_data - start, True, s


async def bench_ttft(
    session: aiohttp.ClientSession, colo: Engine, prefill: Engine, decode: Engine, vocab: int, rounds: int
) -> dict[str, Any]:
    colo_s: list[float] = []
    pd_s: list[float] = []
    fallbacks = 0
    transferred: list[int] = []
    for r in tqdm(range(rounds), desc="transfer rounds", file=sys.stderr):  # A B A B, fresh prompts: cold
        t, fb, _ = await ttft(
            session, colo.url, completion_body(make_prompt(1000 + 2 * r, LONG_PROMPT, vocab), 2)
        )
        colo_s.append(t)
        fallbacks += fb
        body = completion_body(make_prompt(1001 + 2 * r, LONG_PROMPT, vocab), 2, prefill.url)
        t, fb, s = await ttft(session, decode.url, body)
        if s.transfer != "remote":
            raise RuntimeError(
                f"the decode engine did not pull the K/V (x-kvgate-kv-transfer: {s.transfer!r})"
            )
        pd_s.append(t)
        fallbacks += fb
        transferred.append(s.transferred)
        progress(f"  round {r + 1}/{rounds}: colocated {colo_s[-1] * 1e3:.0f} ms, P/D {t * 1e3:.0f} ms")
    colo_med, pd_med = statistics.median(colo_s), statistics.median(pd_s)
    return {
        "prompt_tokens": LONG_PROMPT,
        "rounds": rounds,
        "colocated_s": colo_med,
        "pd_s": pd_med,
        "ratio": pd_med / colo_med,
        "colocated_all_s": colo_s,
        "pd_all_s": pd_s,
        "transferred_tokens": transferred[-1],
        "no_text_fallbacks": fallbacks,
    }


# -- 3. inter-token latency under arriving long prompts -----------------------------------------------------


@dataclass(frozen=True)
class ItlWorkload:
    streams: int
    short_len: int
    decode_max_tokens: int
    long_len: int
    long_every_s: float
    duration_s: float
    warmup_s: float
    grace_s: float
    vocab: int


def raise_failed(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
            raise exc


async def itl_round(
    session: aiohttp.ClientSession,
    target: Engine,
    prefill_url: str | None,
    w: ItlWorkload,
    seed: int,
) -> dict[str, Any]:
    """One bounded run: decode streams all the time, long prompts every ``long_every_s`` in the window."""
    streams: list[Stream] = []
    longs: list[Stream] = []
    stop = asyncio.Event()

    async def decoder(k: int) -> None:
        n = 0
        while not stop.is_set():
            prompt = make_prompt(seed * 100_000 + k * 1000 + n, w.short_len, w.vocab)
            n += 1
            s = Stream(time.perf_counter())
            streams.append(s)
            await stream_completion(session, target.url, completion_body(prompt, w.decode_max_tokens), s)

    async def long_prompt(j: int) -> None:
        prompt = make_prompt(seed * 100_000 + 90_000 + j, w.long_len, w.vocab)
        s = Stream(time.perf_counter())
        longs.append(s)
        await stream_completion(session, target.url, completion_body(prompt, 1, prefill_url), s)
        if prefill_url is not None and s.transfer != "remote":
            raise RuntimeError(f"a long prompt was not transferred (x-kvgate-kv-transfer: {s.transfer!r})")

    cpu0 = time.process_time()
    decoders = [asyncio.create_task(decoder(k)) for k in range(w.streams)]
    longs_tasks: list[asyncio.Task[None]] = []
    try:
        await asyncio.sleep(w.warmup_s)
        t0 = time.perf_counter()
        t1 = t0 + w.duration_s
        j = 0
        while (at := t0 + 0.5 + j * w.long_every_s) < t1:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            longs_tasks.append(asyncio.create_task(long_prompt(j)))
            j += 1
            raise_failed([*decoders, *longs_tasks])  # surface a failure at once
        await asyncio.sleep(max(0.0, t1 - time.perf_counter()) + w.grace_s)
        stop.set()
        raise_failed([*decoders, *longs_tasks])
    finally:
        for task in (*decoders, *longs_tasks):
            task.cancel()
        await asyncio.gather(*decoders, *longs_tasks, return_exceptions=True)
    cpu = time.process_time() - cpu0
    # Gaps that start inside the window; the grace period lets the last ones end.
    gaps = [b - a for s in streams for a, b in zip(s.chunks, s.chunks[1:], strict=False) if t0 <= a < t1]
    done = [s for s in longs if s.done is not None]
    return {
        "gaps": gaps,
        "tokens_in_window": sum(1 for s in streams for t in s.chunks if t0 <= t < t1),
        "long_sent": len(longs),
        "long_done": len(done),
        "long_done_in_window": sum(1 for s in done if s.done is not None and s.done < t1),
        "long_latency": [s.done - s.sent for s in done if s.done is not None],
        "decode_requests": len(streams),
        "client_cpu_s": cpu,
        "window_s": t1 - t0,
    }


async def bench_itl(
    session: aiohttp.ClientSession,
    colo: Engine,
    prefill: Engine,
    decode: Engine,
    w: ItlWorkload,
    rounds: int,
) -> dict[str, Any]:
    pooled: dict[str, dict[str, Any]] = {
        name: {"gaps": [], "long_sent": 0, "long_done": 0, "long_latency": [], "tokens": 0, "cpu": 0.0,
               "window": 0.0, "requests": 0}
        for name in ("colocated", "pd")
    }  # fmt: skip
    for r in tqdm(range(rounds), desc="rounds", file=sys.stderr):  # A B A B: the same machine state
        for name, target, url in (("colocated", colo, None), ("pd", decode, prefill.url)):
            await settle(session, [colo, prefill, decode], w.vocab, seed=500_000 + 10 * r)
            res = await itl_round(session, target, url, w, seed=10 + r)
            p = pooled[name]
            p["gaps"] += res["gaps"]
            p["long_sent"] += res["long_sent"]
            p["long_done"] += res["long_done"]
            p["long_latency"] += res["long_latency"]
            p["tokens"] += res["tokens_in_window"]
            p["cpu"] += res["client_cpu_s"]
            p["window"] += res["window_s"]
            p["requests"] += res["decode_requests"]
            progress(
                f"  round {r + 1}/{rounds} {name}: {len(res['gaps'])} gaps, p99 "
                f"{pct(res['gaps'], 0.99) * 1e3:.0f} ms, long prompts {res['long_done']}/{res['long_sent']}"
            )
    out: dict[str, Any] = {"rounds": rounds, "workload": {k: v for k, v in vars(w).items() if k != "vocab"}}
    for name, p in pooled.items():
        gaps = p["gaps"]
        out[name] = {
            "itl_p50_ms": pct(gaps, 0.50) * 1e3,
            "itl_p90_ms": pct(gaps, 0.90) * 1e3,
            "itl_p99_ms": pct(gaps, 0.99) * 1e3,
            "itl_max_ms": max(gaps) * 1e3,
            "gaps": len(gaps),
            "decode_tokens_per_s": p["tokens"] / p["window"],
            "long_sent": p["long_sent"],
            "long_done": p["long_done"],
            "long_latency_p50_s": statistics.median(p["long_latency"]) if p["long_latency"] else None,
            "decode_requests": p["requests"],
            "client_cpu_share": p["cpu"] / (p["window"] + rounds * (w.warmup_s + w.grace_s)),
        }
    out["p99_ratio"] = out["pd"]["itl_p99_ms"] / out["colocated"]["itl_p99_ms"]
    out["p50_ratio"] = out["pd"]["itl_p50_ms"] / out["colocated"]["itl_p50_ms"]
    return out


# -- the run -------------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, model: str, logdir: Path) -> dict[str, Any]:
    mc = ModelConfig.from_dir(Path(model))
    torch.set_num_threads(1)  # as the decode engine's receiver runs (--threads 1)
    engines: list[Engine] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            progress("starting engines: colocated (core 0), prefill (core 0), decode (core 1)")
            colo = start_engine(model, "colocated", "both", 0, logdir)
            engines.append(colo)
            prefill = start_engine(model, "prefill", "prefill", 0, logdir)
            engines.append(prefill)
            decode = start_engine(model, "decode", "decode", 1, logdir)
            engines.append(decode)
            await wait_healthy(session, engines, 180)
            warm = make_prompt(7, 64, mc.vocab_size)
            for e in engines:  # first steps allocate and warm up kernels
                await stream_completion(session, e.url, completion_body(warm, 2), Stream(time.perf_counter()))
            warm_pd = completion_body(make_prompt(8, 64, mc.vocab_size), 2, prefill.url)
            await stream_completion(session, decode.url, warm_pd, Stream(time.perf_counter()))

            progress(f"1. KV transfer: {args.pulls} pulls of a cached {LONG_PROMPT}-token prompt")
            transfer = await bench_transfer(session, prefill, mc, args.pulls)
            progress(f"2. TTFT of {LONG_PROMPT}-token prompts, cold caches: {args.ttft_rounds} rounds A B")
            ttft_res = await bench_ttft(session, colo, prefill, decode, mc.vocab_size, args.ttft_rounds)
            workload = ItlWorkload(
                streams=args.streams,
                short_len=args.short_len,
                decode_max_tokens=args.decode_max_tokens,
                long_len=args.long_len,
                long_every_s=args.long_every,
                duration_s=args.itl_duration,
                warmup_s=3.0,
                grace_s=4.0,
                vocab=mc.vocab_size,
            )
            progress(
                f"3. ITL: {args.streams} decode streams + a {args.long_len}-token prompt every "
                f"{args.long_every:g} s, {args.itl_rounds} rounds x {args.itl_duration:g} s per setup, A B"
            )
            itl = await bench_itl(session, colo, prefill, decode, workload, args.itl_rounds)
        finally:
            progress("stopping engines")
            stop_engines(engines)
    return {
        "model": {
            "layers": mc.num_hidden_layers,
            "kv_heads": mc.num_key_value_heads,
            "head_dim": mc.head_dim,
            "vocab": mc.vocab_size,
            "parameters_m": round(count_parameters(mc) / 1e6, 1),
            "dtype": "float32",
            "block_size": BLOCK_SIZE,
        },
        "cpus": len(os.sched_getaffinity(0)),
        "transfer": transfer,
        "ttft": ttft_res,
        "itl": itl,
    }


def report(r: dict[str, Any]) -> list[str]:
    """The figures as a short table and one-line conclusions."""
    m, tr, tt, itl = r["model"], r["transfer"], r["ttft"], r["itl"]
    w, colo, pd = itl["workload"], itl["colocated"], itl["pd"]
    lines = [
        f"model: random Llama, {m['parameters_m']:.0f}M params, fp32, {m['layers']} layers x "
        f"{m['kv_heads']} KV heads x {m['head_dim']}, block {m['block_size']}; {r['cpus']} CPUs; "
        "every engine --threads 1, pinned",
        f"1. KV transfer, {tr['positions']} positions = {tr['payload_bytes'] / 1e6:.1f} MB "
        f"(prefill engine had {tr['prefill_cached_tokens']} cached), median of {tr['pulls']} pulls:",
        f"   /v1/kv/prefill -> KvImporter {tr['pull_gb_s']:.2f} GB/s ({tr['pull_s'] * 1e3:.0f} ms); "
        f"torch copy in-process {tr['copy_gb_s']:.2f} GB/s ({tr['copy_s'] * 1e3:.1f} ms) "
        f"-> ratio {tr['ratio']:.3f}",
        f"   control, the same pull of the last position only: {tr['control_s'] * 1e3:.0f} ms (the prefill "
        f"engine recomputes {tr['positions'] - tr['prefill_cached_tokens']} tokens); without it: "
        + (
            f"{tr['net_gb_s']:.2f} GB/s -> ratio {tr['net_ratio']:.3f}"
            if tr["net_gb_s"] is not None
            else "n/a (the control took as long as the pull)"
        ),
        f"2. TTFT of a {tt['prompt_tokens']}-token prompt, cold caches, streaming, "
        f"median of {tt['rounds']} A B:",
        f"   colocated (1 process) {tt['colocated_s'] * 1e3:.0f} ms; P/D (2 processes, "
        f"{tt['transferred_tokens']} positions pulled) {tt['pd_s'] * 1e3:.0f} ms -> ratio {tt['ratio']:.3f}"
        + (
            f" ({tt['no_text_fallbacks']} had no text: timed to their first data chunk)"
            if tt["no_text_fallbacks"]
            else ""
        ),
        f"3. ITL of {w['streams']} decode streams ({w['short_len']}-token prompts, max_tokens "
        f"{w['decode_max_tokens']}) while a {w['long_len']}-token prompt arrives every "
        f"{w['long_every_s']:g} s; {itl['rounds']} rounds x {w['duration_s']:g} s each, A B:",
        f"   {'':20s} {'p50 ms':>7s} {'p90 ms':>7s} {'p99 ms':>7s} {'max ms':>7s} {'gaps':>6s} "
        f"{'tok/s':>6s} {'long done':>9s} {'long p50 s':>10s}",
    ]
    for label, x in (("colocated (core 0)", colo), ("P/D (cores 0 + 1)", pd)):
        lat = f"{x['long_latency_p50_s']:.2f}" if x["long_latency_p50_s"] is not None else "-"
        lines.append(
            f"   {label:20s} {x['itl_p50_ms']:7.0f} {x['itl_p90_ms']:7.0f} {x['itl_p99_ms']:7.0f} "
            f"{x['itl_max_ms']:7.0f} {x['gaps']:6d} {x['decode_tokens_per_s']:6.1f} "
            f"{x['long_done']:>4d}/{x['long_sent']:<4d} {lat:>10s}"
        )
    lines += [
        f"   ratio P/D / colocated: p99 {itl['p99_ratio']:.3f}, p50 {itl['p50_ratio']:.3f} (this client, "
        f"unpinned, used {colo['client_cpu_share']:.0%} / {pd['client_cpu_share']:.0%} of a core)",
        "conclusions:",
        f"- pulling cached K/V runs at {tr['ratio']:.3f}x the speed of an in-process copy of the same "
        f"bytes ({tr['pull_gb_s']:.2f} vs {tr['copy_gb_s']:.2f} GB/s); "
        f"{tr['control_s'] / tr['pull_s']:.0%} of a pull's time is the prefill engine's recompute and "
        "per-request cost, not bytes.",
        f"- on a cold {tt['prompt_tokens']}-token prompt the P/D TTFT is {tt['ratio']:.2f}x the colocated "
        f"one ({(tt['pd_s'] - tt['colocated_s']) * 1e3:+.0f} ms; the K/V streams out layer by layer "
        "while the prefill computes), using two processes instead of one.",
        f"- with long prompts arriving, the P/D pair's decode ITL p99 is {itl['p99_ratio']:.2f}x the "
        f"colocated engine's ({pd['itl_p99_ms']:.0f} vs {colo['itl_p99_ms']:.0f} ms), on twice the cores.",
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="model directory (default: make a 'small' random model in a temp dir)"
    )
    parser.add_argument("--pulls", type=int, default=5, help="KV pulls (and copies) measured in 1")
    parser.add_argument("--ttft-rounds", type=int, default=5, help="A B rounds of 2")
    parser.add_argument("--itl-rounds", type=int, default=2, help="A B rounds of 3")
    parser.add_argument("--itl-duration", type=float, default=20.0, help="seconds per setup per round in 3")
    parser.add_argument("--streams", type=int, default=4, help="concurrent decode streams in 3")
    parser.add_argument("--short-len", type=int, default=32, help="prompt tokens of the decode streams")
    parser.add_argument("--decode-max-tokens", type=int, default=512, help="max_tokens of the decode streams")
    parser.add_argument("--long-len", type=int, default=512, help="tokens of the long prompts in 3")
    parser.add_argument("--long-every", type=float, default=4.0, help="seconds between long prompts in 3")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)"
    )
    args = parser.parse_args()
    if not {0, 1} <= os.sched_getaffinity(0) or shutil.which("taskset") is None:
        parser.error("needs cores 0 and 1 and the taskset command")

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the engines

    signal.signal(signal.SIGTERM, terminate)
    # Ctrl-C raises KeyboardInterrupt even when a shell started us with SIGINT ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-pd-") as tmp:
        model = args.model or small_model(Path(tmp))
        try:
            result = asyncio.run(run(args, model, Path(tmp)))
        except KeyboardInterrupt:
            progress("interrupted; the engines are stopped")
            return 130
    progress("done")
    # With --json the table goes to stderr and stdout carries one JSON object.
    print("\n".join(report(result)), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
