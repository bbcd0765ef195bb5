"""kvgate side by side with the Rust routers (sglang-router, vllm-router, smg), in front of the same simulated
engines, on the same requests, in one run.

    python tests/bench/bench_routers.py [--peers-venv DIR] [--smg-venv DIR] [--rounds 3] [--json]

Peers are found in ``--peers-venv`` (sglang-router and vllm-router, see ../shared/BENCHMARKS.md) and
``--smg-venv`` (smg), or ``KVGATE_PEERS_VENV`` / ``KVGATE_SMG_VENV``; one that is not installed is skipped
with a line saying so. Every router runs in its own process in front of 4 simulated engines
(``python -m engine.sim``, each its own process) that answer the probes the peers need (``/health``,
``/v1/models``, ``/server_info``, ``/model_info``, ``/tokenize``) and report a local byte-level tokenizer
(one token per byte), so no router downloads anything.

1. Overhead: added latency at concurrency 1 (p50, p99; every request goes down every path, direct, kvgate,
   each peer, in a new random order each time) and throughput at concurrency 32 (rounds interleaved, in
   random order), against direct; with each router's CPU per request at c=32, and the engines' (they share
   this machine's cores, so what they spend per request through a router counts in its throughput).
2. The Mooncake conversation trace (``tests/data``), time-compressed: every hash id becomes the same 512-token
   text wherever it occurs, so prompts share prefixes exactly as in the trace; every router gets the same
   requests with the same ``x-session-affinity`` (the conversation key of region_map.simulation.trace). Hit
   rate from the engines' reported ``cached_tokens``, TTFT p50/p90 of streamed answers, max/mean requests per
   engine; and, request by request, kvgate's TTFT minus each other router's where both got the same cached
   tokens (their own overheads apart from their routing, within this machine's noise).
3. Prompt length: a new prompt (cached nowhere) of 2k, 14k and 40k tokens, one at a time down every path,
   median time to first byte; and kvgate's mean receive-to-dispatch time (tokenize, hash, route) per length.
   What a router's own work costs a long prompt, apart from routing and contention.
``--words`` builds the trace's texts and these prompts from words and spaces, with a tokenizer that splits
words apart first (GPT-2's pattern) as production BPE tokenizers do; kvgate's tokenizer then caches a
conversation's earlier chunks (cache.token_chunks), which the one-word default texts never allow.
``KVGATE_BENCH_TOKEN_IDS=false`` makes kvgate send the prompt as text instead of ``prompt_token_ids``;
``KVGATE_BENCH_WORKERS=N`` runs it with ``--workers N`` (with ``KVGATE_BENCH_REDIS=URL`` they share
sessions and the ledger in Redis, as a multi-worker deployment would); ``KVGATE_BENCH_POLICY`` picks its
routing policy and ``KVGATE_BENCH_ROUTING`` adds lines to its ``[gateway.routing]`` table (e.g.
``load_penalty_tokens = 0``). ``--baseline-checkout DIR`` runs a second kvgate from another checkout (``git
worktree add DIR COMMIT``) as ``kvgate@base`` in both parts: before and after in the same run.
P/D mode (the issue's third measure) is not run: the simulated engines implement none of the peers' P/D
transfer protocols, and a router in P/D mode in front of engines that cannot transfer measures nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_overhead import MODEL, cpu_seconds, one, pct, start_floor, throughput_round, tree_launch
from trace_workload import LENGTHS, TRACE, by_length, engine_counts, overhead_mean_ms, paired_with, replay

from gateway.demo import EngineProcess, free_port, stop_engines, wait_healthy
from gateway.http.loop import install_best_loop, raise_open_file_limit
from gateway.http.upstream import UpstreamPool
from region_map.simulation.trace import load_trace

SYSTEM = "You are a helpful assistant. " * 60
# A pull from a peer engine costs this fraction of computing the same tokens (the engines' default ratio:
# 1.2e-5 against 5e-5 s per token); kvgate's estimate is told the same, as an operator would configure it.
PULL_FRACTION = 0.24


def byte_tokenizer_dir(directory: Path, *, split_words: bool = False) -> Path:
    """A Hugging Face tokenizer that maps every byte to one token (no merges: text of N ASCII bytes is N
    tokens for every router and engine alike), with ChatML's special tokens and chat template. It reads a
    text as one word, or with ``split_words`` splits it into words first with GPT-2's pattern, as the
    production byte-level BPEs do (same tokens, about 2.5x the time per character)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": eos}))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = {"eos_token": "<|im_end|>", "model_max_length": 1 << 20, "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


# -- processes ---------------------------------------------------------------------------------------------


def start_engines(
    count: int, tokenizer: Path, *, prefill_s: float, decode_s: float, capacity: int
) -> list[EngineProcess]:
    engines = []
    for i in range(count):
        port = free_port()
        cmd = [sys.executable, "-m", "engine.sim", "--port", str(port), "--model", MODEL,
               "--engine-id", f"bench/e{i}", "--tokenizer", str(tokenizer),
               "--prefill-s-per-token", str(prefill_s), "--decode-s-per-token", str(decode_s),
               "--kv-pull-s-per-token", str(prefill_s * PULL_FRACTION),
               "--capacity-blocks", str(capacity), "--max-running", "4096"]  # fmt: skip
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engines.append(EngineProcess("bench", f"e{i}", port, process))
    return engines


@dataclass
class Router:
    name: str
    port: int
    process: subprocess.Popen[bytes]


def start_kvgate(
    engines: list[EngineProcess],
    tokenizer: Path,
    workdir: Path,
    prefill_s_per_token: float = 5e-5,
    *,
    checkout: Path | None = None,
) -> Router:
    """kvgate in front of ``engines``, its prefill cost estimate set to theirs (as an operator would); from
    another ``checkout`` of kvgate (an earlier commit's worktree) when given, named ``kvgate@base``."""
    name = "kvgate" if checkout is None else "kvgate@base"
    port = free_port()
    ids = os.environ.get("KVGATE_BENCH_TOKEN_IDS", "true")
    lines = ",\n".join(
        f'  {{ name = "{e.name}", url = "{e.url}", model = "{MODEL}", accepts_token_ids = {ids} }}'
        for e in engines
    )
    redis = os.environ.get("KVGATE_BENCH_REDIS")  # workers share sessions through it, as deployed
    prefix = f"kvgate-bench-{os.getpid()}-{port}"
    redis_lines = f'redis_url = "{redis}"\nredis_prefix = "{prefix}"\n' if redis else ""
    config = workdir / f"{name}.toml"
    config.write_text(
        f'region = "bench"\n[[regions]]\nname = "bench"\nengines = [\n{lines}\n]\n'
        f'[gateway]\nport = {port}\ntokenizer = "{tokenizer}"\naccess_log = false\n'
        f"{redis_lines}"
        f'[gateway.routing]\npolicy = "{os.environ.get("KVGATE_BENCH_POLICY", "default")}"\n'
        f"prefill_s_per_token = {prefill_s_per_token!r}\n"
        f"kv_pull_s_per_token = {prefill_s_per_token * PULL_FRACTION!r}\n"
        f"{os.environ.get('KVGATE_BENCH_ROUTING', '')}\n"
    )
    cmd = [sys.executable, "-m", "gateway.cli", "--log-level", "warning", "serve", "--config", str(config),
           "--workers", os.environ.get("KVGATE_BENCH_WORKERS", "1")]  # fmt: skip
    launch = {} if checkout is None else tree_launch(checkout)
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, **launch)
    return Router(name, port, process)


def peer_commands(peers_venv: Path | None, smg_venv: Path | None) -> dict[str, list[str]]:
    """name -> command prefix (ports and workers appended); a missing peer is reported and skipped."""
    found: dict[str, list[str]] = {}
    if peers_venv is not None and (peers_venv / "bin" / "python").exists():
        python = str(peers_venv / "bin" / "python")
        if subprocess.run([python, "-c", "import sglang_router"], capture_output=True).returncode == 0:
            found["sglang-router"] = [python, "-m", "sglang_router.launch_router"]
        if (peers_venv / "bin" / "vllm-router").exists():
            found["vllm-router"] = [str(peers_venv / "bin" / "vllm-router")]
    if smg_venv is not None and (smg_venv / "bin" / "smg").exists():
        found["smg"] = [str(smg_venv / "bin" / "smg"), "launch"]
    for name in ("sglang-router", "vllm-router", "smg"):
        if name not in found:
            print(f"{name}: not installed, skipped (see ../shared/BENCHMARKS.md)", file=sys.stderr)
    return found


def start_peer(name: str, prefix: list[str], engines: list[EngineProcess]) -> Router:
    port = free_port()
    log_level = "warning" if name == "vllm-router" else "warn"
    cmd = [*prefix, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--worker-urls", *[e.url for e in engines],
           "--policy", "cache_aware", "--log-level", log_level]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return Router(
        name,
        port,
        subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        ),
    )


async def wait_ready(router: Router, timeout_s: float = 60.0) -> bool:
    """Ready = a chat completion through it succeeds (health endpoints differ between routers)."""
    pool = UpstreamPool("127.0.0.1", router.port)
    deadline = time.monotonic() + timeout_s
    payload = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    try:
        while time.monotonic() < deadline:
            if router.process.poll() is not None:
                return False
            try:
                r = await pool.request("POST", "/v1/chat/completions", payload,
                                       [("Content-Type", "application/json")], header_timeout=5)  # fmt: skip
                await r.read(5)
                if r.status == 200:
                    return True
            except Exception:
                pass
            await asyncio.sleep(0.3)
        return False
    finally:
        pool.close()


# -- part 1: overhead --------------------------------------------------------------------------------------


def chat_body(i: int) -> bytes:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"question number {i % 50}"},
    ]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 8})


async def overhead(
    ports: dict[str, int],
    pids: dict[str, int],
    engines: list[EngineProcess],
    rounds: int,
    n: int,
    concurrency: int,
    duration_s: float,
) -> dict[str, Any]:
    """Added latency at c=1 and throughput at ``concurrency``; and, from /proc over the throughput rounds,
    each router's CPU per request (``pids``: its process, with its threads and children) and the engines'
    (``engines``): on this machine the engines share the cores with the router, so what a router costs
    them per request (a request they answer at a lower rate costs them more) weighs in its throughput. And
    how a router spread those requests over the engines (max/mean of their counts: 1 is even, 4 all on
    one): on these shared cores, waking four engine processes costs more CPU than waking one, which a
    router that stacks every request on one engine does not pay (on GPUs, spreading is what keeps
    batches small)."""
    engine_pids = [e.process.pid for e in engines]
    pools = {name: UpstreamPool("127.0.0.1", port, max_idle=concurrency) for name, port in ports.items()}
    for pool in pools.values():
        for i in range(100):
            await one(pool, chat_body(i))
    latency: dict[str, list[float]] = {name: [] for name in pools}
    rps: dict[str, list[float]] = {name: [] for name in pools}
    cpu: dict[str, list[float]] = {name: [] for name in pools}  # seconds per request, per round
    engine_cpu: dict[str, list[float]] = {name: [] for name in pools}
    spread: dict[str, list[float]] = {name: [] for name in pools}
    order = list(pools)
    shuffle = random.Random(0).shuffle
    for _ in tqdm(range(rounds), desc="overhead rounds", file=sys.stderr):
        for i in range(n):
            # Every path once per request, so that all see the same machine state; in a new order each time,
            # since the path right after another one measurably gains or loses by its place.
            shuffle(order)
            for name in order:
                latency[name].append(await one(pools[name], chat_body(i)))
        shuffle(order)
        for name in order:
            counts = await engine_counts(engines)  # (scraped outside the CPU readings)
            router_cpu, engines_cpu = _cpu(pids.get(name)), sum(map(_cpu, engine_pids))
            started = time.perf_counter()
            rate = await throughput_round(pools[name], concurrency, duration_s, chat_body)
            requests = rate * (time.perf_counter() - started)
            rps[name].append(rate)
            cpu[name].append((_cpu(pids.get(name)) - router_cpu) / requests)
            engine_cpu[name].append((sum(map(_cpu, engine_pids)) - engines_cpu) / requests)
            served = [a - b for a, b in zip(await engine_counts(engines), counts, strict=True)]
            spread[name].append(max(served) / (sum(served) / len(served)) if sum(served) else 0.0)
    for pool in pools.values():
        pool.close()
    d50, d99, drps = (
        statistics.median(latency["direct"]),
        pct(latency["direct"], 0.99),
        statistics.median(rps["direct"]),
    )
    return {
        name: {"added_p50_ms": (statistics.median(v) - d50) * 1e3, "added_p99_ms": (pct(v, 0.99) - d99) * 1e3,
               "req_s": statistics.median(rps[name]), "throughput_ratio": statistics.median(rps[name]) / drps,
               "router_cpu_ms": statistics.median(cpu[name]) * 1e3,
               "engines_cpu_ms": statistics.median(engine_cpu[name]) * 1e3,
               "engines_max_over_mean": statistics.median(spread[name])}
        for name, v in latency.items()
    }  # fmt: skip


def _cpu(pid: int | None) -> float:
    """CPU seconds of ``pid`` and its descendants; 0 for none (direct has no router)."""
    return 0.0 if pid is None else cpu_seconds(pid)


class _Skip(Exception):
    pass


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated runs (a router missing from a run is left out of its median)."""
    out: dict[str, Any] = {"peers": runs[0]["peers"], "runs": len(runs)}
    for part in ("overhead", "lengths", "trace"):
        names = list(dict.fromkeys(name for run in runs for name in run[part]))
        out[part] = {
            name: {
                key: statistics.median(run[part][name][key] for run in runs if name in run[part])
                for key in next(run[part][name] for run in runs if name in run[part])
            }
            for name in names
        }
    return out


# -- main --------------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    peers = {n: c for n, c in peer_commands(args.peers_venv, args.smg_venv).items() if n in args.routers}
    results: dict[str, Any] = {"peers": sorted(peers), "overhead": {}, "lengths": {}, "trace": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tok = byte_tokenizer_dir(Path(tmp) / "tokenizer", split_words=args.words)
        # Parts 1 and 3: zero-cost engines, pure routing overhead.
        engines = (
            start_engines(4, tok, prefill_s=0.0, decode_s=0.0, capacity=4096)
            if args.parts & {"overhead", "lengths"}
            else []
        )
        routers: list[Router] = []
        try:
            if not engines:
                raise _Skip
            await wait_healthy(engines)
            routers = [start_kvgate(engines, tok, Path(tmp))] if "kvgate" in args.routers else []
            if args.baseline_checkout is not None:
                routers.append(start_kvgate(engines, tok, Path(tmp), checkout=args.baseline_checkout))
            routers += [start_peer(n, c, engines) for n, c in peers.items()]
            # The floor of any Python proxy on kvgate's stack (aiohttp server + its upstream client, bytes
            # forwarded to one engine, no parsing or routing): what is left to win by routing work alone.
            floor_process, floor_port = start_floor(engines[0].port)
            routers.append(Router("python floor", floor_port, floor_process))
            ready = {r.name: await wait_ready(r) for r in routers}
            for name, ok in ready.items():
                if not ok:
                    print(f"{name}: did not become ready, skipped", file=sys.stderr)
            ports = {"direct": engines[0].port} | {r.name: r.port for r in routers if ready[r.name]}
            if "overhead" in args.parts:
                pids = {r.name: r.process.pid for r in routers if ready[r.name]}
                results["overhead"] = await overhead(
                    ports, pids, engines, args.rounds, args.requests, 32, args.duration
                )
            if "lengths" in args.parts:
                results["lengths"] = await by_length(ports, args.length_requests, words=args.words)
        except _Skip:
            pass
        finally:
            for r in routers:
                r.process.terminate()
                r.process.wait(10)
            stop_engines(engines)
        # Part 2: the trace, fresh engines (empty caches) for every router, one router at a time.
        trace = load_trace(TRACE, limit=args.trace_requests)
        per_request: dict[str, list[tuple[float, int] | None]] = {}
        names = ["kvgate", "kvgate@base", *peers]
        if args.baseline_checkout is not None:
            args.routers.add("kvgate@base")
        for name in [n for n in names if "trace" in args.parts and n in args.routers]:
            engines = start_engines(4, tok, prefill_s=args.prefill_s, decode_s=0.001, capacity=args.capacity)
            router = None
            try:
                await wait_healthy(engines)
                if name.startswith("kvgate"):
                    base = args.baseline_checkout if name == "kvgate@base" else None
                    router = start_kvgate(engines, tok, Path(tmp), args.prefill_s, checkout=base)
                else:
                    router = start_peer(name, peers[name], engines)
                if not await wait_ready(router):
                    print(f"{name}: did not become ready for the trace, skipped", file=sys.stderr)
                    continue
                before = await engine_counts(engines)
                figures = await replay(router.port, trace, args.speedup, words=args.words)
                counts = [a - b for a, b in zip(await engine_counts(engines), before, strict=True)]
                figures["load_max_over_mean"] = (
                    max(counts) / (sum(counts) / len(counts)) if sum(counts) else 0.0
                )
                if name.startswith("kvgate"):
                    figures["gateway_overhead_ms"] = await overhead_mean_ms(router.port)
                per_request[name] = figures.pop("per_request")
                results["trace"][name] = figures
            finally:
                if router is not None:
                    router.process.terminate()
                    router.process.wait(10)
                stop_engines(engines)
        if "kvgate" in per_request:
            for name, theirs in per_request.items():
                if name != "kvgate":
                    results["trace"][name] |= paired_with(per_request["kvgate"], theirs)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers-venv", type=Path, default=os.environ.get("KVGATE_PEERS_VENV"))
    parser.add_argument("--smg-venv", type=Path, default=os.environ.get("KVGATE_SMG_VENV"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="requests per path per latency round")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per throughput round")
    parser.add_argument("--trace-requests", type=int, default=1500, help="the first N requests of the trace")
    parser.add_argument("--speedup", type=float, default=20.0, help="time compression of the trace")
    parser.add_argument("--prefill-s", type=float, default=2e-6, help="simulated prefill seconds per token")
    parser.add_argument(
        "--capacity", type=int, default=2000 * 32, help="prefix cache per engine, 16-token blocks"
    )
    parser.add_argument(
        "--parts", default="overhead,trace,lengths", help="which measures to run (comma-separated)"
    )
    parser.add_argument("--length-requests", type=int, default=25, help="requests per path and prompt length")
    parser.add_argument(
        "--routers", default="kvgate,sglang-router,vllm-router,smg", help="which routers to run"
    )
    parser.add_argument(
        "--baseline-checkout",
        type=Path,
        help="another kvgate checkout (git worktree add DIR COMMIT) run beside this one as kvgate@base",
    )
    parser.add_argument(
        "--words",
        action="store_true",
        help="prompts of words and spaces, and a tokenizer that splits words apart (see trace_workload)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="run everything N times and report medians")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.parts, args.routers = set(args.parts.split(",")), set(args.routers.split(","))
    install_best_loop()
    raise_open_file_limit()
    runs = [asyncio.run(run(args)) for _ in range(args.repeat)]
    results = median_of(runs)
    print(
        "\n1. overhead: 4 zero-cost simulated engines; c=1 latency interleaved per request, c=32 throughput"
    )
    print(
        f"{'router':14s} {'added p50':>10s} {'added p99':>10s} {'req/s c=32':>11s} {'ratio':>6s}"
        f" {'router CPU/req':>15s} {'engines CPU/req':>16s} {'engines max/mean':>16s}"
    )
    for name, r in results["overhead"].items():
        added = f"{r['added_p50_ms']:+9.3f}ms {r['added_p99_ms']:+9.3f}ms"
        cpu = f"{r['router_cpu_ms']:13.3f}ms {r['engines_cpu_ms']:14.3f}ms"
        spread = r["engines_max_over_mean"]
        print(f"{name:14s} {added} {r['req_s']:11.0f} {r['throughput_ratio']:6.2f} {cpu} {spread:16.2f}")
    print("(CPU per request at c=32 from /proc: the router's process with its threads and children, and the")
    print(" four engines', which share this machine's cores with it; engines max/mean: how the router spread")
    print(" its c=32 requests, 1.00 even, 4.00 all on one engine, which costs these shared cores least)")
    print(f"\n2. Mooncake trace: first {args.trace_requests} requests, {args.speedup:g}x faster, 4 engines")
    columns = ("hit rate", "TTFT p50", "TTFT p90", "load max/mean", "errors")
    print(f"{'router':14s} " + " ".join(f"{c:>9s}" for c in columns))
    for name, r in results["trace"].items():
        ttft = f"{r['ttft_p50_s'] * 1e3:7.1f}ms {r['ttft_p90_s'] * 1e3:7.1f}ms"
        print(f"{name:14s} {r['hit_rate']:9.1%} {ttft} {r['load_max_over_mean']:14.2f} {r['errors']:7.0f}")
    for name, r in results["trace"].items():
        if "paired_p50_ms" in r:
            share = r["same_cached_share"]
            print(f"kvgate - {name}, TTFT per request on the {share:.0%} both answered with the same cached "
                  f"tokens: p10 {r['paired_p10_ms']:+.2f} p50 {r['paired_p50_ms']:+.2f} "
                  f"p90 {r['paired_p90_ms']:+.2f} ms")  # fmt: skip
    for name, r in results["trace"].items():
        if "gateway_overhead_ms" in r:
            mean = r["gateway_overhead_ms"]
            print(f"{name}: receive-to-dispatch (kvgate_routing_overhead_seconds) mean {mean:.2f} ms")
    if results["lengths"]:
        print("\n3. a new prompt at a time (cached nowhere): median time to first byte, ms, by prompt tokens")
        print(f"{'router':16s} " + " ".join(f"{n:>11,d}" for n in LENGTHS))
        for name, by_tokens in results["lengths"].items():
            print(f"{name:16s} " + " ".join(f"{by_tokens[n] * 1e3:11.2f}" for n in LENGTHS))
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
