"""Agent fan-outs through kvgate: parallel tool calls that share one growing conversation prefix.

    python tests/bench/bench_fanout.py [--baseline-checkout DIR] [--rounds 3] [--agents 24] [--turns 6]
                                       [--fanout 8] [--stream mix|on|off] [--modes affinity,none] [--json]

The workload. ``--agents`` agents (24) run concurrently, agent ``a`` starting ``a * --stagger`` seconds in.
Each runs ``--turns`` turns (6); a turn is a fan-out of ``--fanout`` (8) chat completions sent at the same
instant (the tool calls an agent makes in parallel), all sharing the agent's conversation so far as their
prefix: its own system prompt (``--system-tokens``, distinct per agent; ``--shared-system-tokens`` puts a
prefix common to all agents in front of it), its task, and for every earlier turn an assistant message and
the tool results (``--turn-tokens`` in all, about 300). Each request of a fan-out then appends its own short
distinct user message (the tool call). ``max_tokens`` is ``--max-tokens`` (16). With ``--stream mix`` the
even-numbered calls of every fan-out stream (with ``include_usage``) and the odd ones do not. When a fan-out
has all its answers the agent waits ``--think`` seconds (a seeded jitter of +-50%) and starts its next turn.
Every run sends the same requests at the same moments (seeded).

Each run is either mode: ``affinity`` sends ``x-session-affinity: agent-<a>`` with every request of agent
``a``, ``none`` sends no session header. Every (build, mode) pair gets its own 4 fresh simulated engines
(empty caches, ``python -m engine.sim``, configured as in bench_routers' trace part: ``--prefill-s``
2e-6 s per uncached prompt token, 1 ms per output token, ``--capacity`` 64000 blocks of 16 tokens,
``--max-running 4096``) and its own fresh kvgate (its default policy, prefill cost estimate set to the
engines'; bench_routers.start_kvgate), with the byte tokenizer (one token per byte). The builds are this
checkout (``kvgate``) and, with ``--baseline-checkout DIR`` (``git worktree add DIR COMMIT``), that checkout
(``kvgate@base``), run in the same process tree under its PYTHONPATH. Rounds are interleaved: every round
runs every (build, mode) pair once, in a new seeded order; figures are medians over rounds, with the
min-max spread over rounds in parentheses.

The figures, per build and mode:
  runs         runs that answered / runs (one whose every request failed, or whose kvgate never became
               ready, is left out of the figures: this checkout may be caught mid-edit)
  hit all      sum(cached_tokens) / sum(prompt_tokens) over every request (the engines' usage)
  hit t>=2     the same over turns 2 and later (turn 1 finds nothing of the agent cached anywhere)
  eng/fan      mean number of distinct engines (``x-kvgate-engine``) among the requests of a fan-out
  1-eng        share of fan-outs whose requests all landed on one engine
  t>=2 c>0     share of the requests of turns 2 and later that found anything cached (cached_tokens > 0)
  TTFT p50/p90 of the streamed requests: time from sending to the first body bytes
  errors       requests that failed (not 200, or no usage)
The JSON (``--json``) also holds every round's figures, the non-streamed requests' latency, and the
checkout's state (HEAD, and a hash of its uncommitted diff at each run: this checkout may change while the
bench runs, since every run starts a new kvgate from the files as they are then).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_overhead import MODEL, pct
from bench_routers import Router, byte_tokenizer_dir, start_engines, start_kvgate, wait_ready

from gateway.demo import stop_engines, wait_healthy
from gateway.http.loop import install_best_loop, raise_open_file_limit
from gateway.http.upstream import UpstreamPool

REPO = Path(__file__).resolve().parents[2]
_WORDS = (
    "alpha", "build", "cache", "delta", "engine", "file", "graph", "hash", "index", "join", "kernel", "log",
    "merge", "node", "order", "patch", "query", "route", "scan", "table", "unit", "value", "write", "yield",
)  # fmt: skip


def words(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens (bytes, with the byte tokenizer) of ASCII words drawn from ``rng``."""
    out: list[str] = []
    size = 0
    while size < tokens:
        word = rng.choice(_WORDS) + str(rng.randrange(1000))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:tokens]


# -- the workload --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    agent: int
    turn: int  # 1-based
    index: int  # within the fan-out
    stream: bool
    body: bytes


@dataclass(frozen=True)
class Agent:
    start_s: float
    turns: list[list[Call]]  # one fan-out per turn
    think_s: list[float]  # the wait after each turn


def build_workload(args: argparse.Namespace) -> list[Agent]:
    rng = random.Random(20240611)
    shared = words(rng, args.shared_system_tokens) + "\n" if args.shared_system_tokens else ""
    agents = []
    for a in range(args.agents):
        system = shared + f"You are agent {a}. " + words(rng, args.system_tokens)
        history: list[dict[str, str]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Task of agent {a}: " + words(rng, args.task_tokens)},
        ]
        turns = []
        for t in range(1, args.turns + 1):
            calls = []
            for k in range(args.fanout):
                stream = args.stream == "on" or (args.stream == "mix" and k % 2 == 0)
                tool_call = {"role": "user", "content": f"Tool call {k} of turn {t}: " + words(rng, 24)}
                body: dict[str, Any] = {"model": MODEL, "messages": [*history, tool_call],
                                        "max_tokens": args.max_tokens, "stream": stream}  # fmt: skip
                if stream:
                    body["stream_options"] = {"include_usage": True}
                calls.append(Call(a, t, k, stream, orjson.dumps(body)))
            turns.append(calls)
            # The next turn's prefix: this one's, then what the agent said and what its tools returned.
            said = max(1, args.turn_tokens // 5)
            results = f"Tool results of turn {t}: " + words(rng, args.turn_tokens - said)
            history = [
                *history,
                {"role": "assistant", "content": f"Turn {t}: " + words(rng, said)},
                {"role": "user", "content": results},
            ]
        think = [args.think * rng.uniform(0.5, 1.5) for _ in range(args.turns)]
        agents.append(Agent(a * args.stagger, turns, think))
    return agents


@dataclass
class Result:
    agent: int
    turn: int
    stream: bool
    ok: bool = False
    prompt: int = 0
    cached: int = 0
    engine: str = ""
    ttft_s: float | None = None  # streamed: first body bytes
    latency_s: float = 0.0  # the whole answer


async def send(pool: UpstreamPool, call: Call, affinity: bool) -> Result:
    result = Result(call.agent, call.turn, call.stream)
    headers = [("Content-Type", "application/json")]
    if affinity:
        headers.append(("x-session-affinity", f"agent-{call.agent}"))
    start = time.perf_counter()
    try:
        resp = await pool.request("POST", "/v1/chat/completions", call.body, headers, header_timeout=120)
        result.engine = (resp.header(b"x-kvgate-engine") or b"").decode()
        first = await resp.next_batch(120)
        if call.stream:
            result.ttft_s = time.perf_counter() - start
        data = (first or b"") + await resp.read(120)
        result.latency_s = time.perf_counter() - start
        usage = None
        if call.stream:
            for line in data.split(b"\n"):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = orjson.loads(line[6:]).get("usage") or usage
        elif resp.status == 200:
            usage = orjson.loads(data).get("usage")
        if resp.status == 200 and usage:
            result.prompt = usage["prompt_tokens"]
            result.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            result.ok = True
    except Exception:
        pass
    return result


async def run_workload(port: int, agents: list[Agent], affinity: bool) -> list[list[Result]]:
    """Every agent's turns against the gateway at ``port``; one list of results per fan-out."""
    pool = UpstreamPool("127.0.0.1", port, max_idle=256)
    fanouts: list[list[Result]] = []
    t0 = time.perf_counter()

    async def agent_loop(agent: Agent) -> None:
        await asyncio.sleep(max(0.0, agent.start_s - (time.perf_counter() - t0)))
        for calls, think in zip(agent.turns, agent.think_s, strict=True):
            fanouts.append(list(await asyncio.gather(*(send(pool, c, affinity) for c in calls))))
            await asyncio.sleep(think)

    try:
        await asyncio.gather(*(agent_loop(a) for a in agents))
    finally:
        pool.close()
    return fanouts


def figures(fanouts: list[list[Result]]) -> dict[str, float]:
    every = [r for f in fanouts for r in f]
    done = [r for r in every if r.ok]
    later = [r for r in done if r.turn >= 2]

    def hit(rs: list[Result]) -> float:
        prompt = sum(r.prompt for r in rs)
        return sum(r.cached for r in rs) / prompt if prompt else 0.0

    engines = [len({r.engine for r in f if r.engine}) for f in fanouts]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    whole = [r.latency_s for r in done if not r.stream]
    nan = float("nan")
    return {
        "hit_rate": hit(done),
        "hit_rate_turn2plus": hit(later),
        "engines_per_fanout": statistics.mean(engines) if engines else nan,
        "one_engine_share": sum(n == 1 for n in engines) / len(engines) if engines else nan,
        "turn2plus_cached_share": sum(r.cached > 0 for r in later) / len(later) if later else nan,
        "ttft_p50_s": pct(ttft, 0.5) if ttft else nan,
        "ttft_p90_s": pct(ttft, 0.9) if ttft else nan,
        "nonstream_latency_p50_s": pct(whole, 0.5) if whole else nan,
        "nonstream_latency_p90_s": pct(whole, 0.9) if whole else nan,
        "requests": len(every),
        "errors": len(every) - len(done),
    }


# -- runs --------------------------------------------------------------------------------------------------


def checkout_state(path: Path) -> dict[str, str]:
    """HEAD and a short hash of the checkout's uncommitted changes (the diff, and any new files)."""

    def git(*cmd: str) -> bytes:
        return subprocess.run(["git", "-C", str(path), *cmd], capture_output=True, check=False).stdout

    diff = git("diff", "HEAD")
    for name in sorted(git("ls-files", "--others", "--exclude-standard").decode().splitlines()):
        with contextlib.suppress(OSError):  # (removed meanwhile)
            diff += name.encode() + (path / name).read_bytes()  # new files: not in the diff
    return {
        "head": git("rev-parse", "--short", "HEAD").decode().strip(),
        "diff": hashlib.sha1(diff).hexdigest()[:10] if diff else "clean",
    }


@dataclass
class Runs:
    rounds: dict[tuple[str, str], list[dict[str, float]]] = field(default_factory=dict)
    states: dict[str, list[dict[str, str]]] = field(default_factory=dict)


async def one_run(
    args: argparse.Namespace, agents: list[Agent], tok: Path, workdir: Path, checkout: Path | None, mode: str
) -> dict[str, float]:
    engines = start_engines(4, tok, prefill_s=args.prefill_s, decode_s=0.001, capacity=args.capacity)
    router: Router | None = None
    try:
        await wait_healthy(engines)
        router = start_kvgate(engines, tok, workdir, args.prefill_s, checkout=checkout)
        if not await wait_ready(router):
            print(f"{router.name} did not become ready: this run failed", file=sys.stderr)
            return figures([])
        return figures(await run_workload(router.port, agents, mode == "affinity"))
    finally:
        if router is not None:
            router.process.terminate()
            router.process.wait(10)
        stop_engines(engines)


async def run(args: argparse.Namespace) -> Runs:
    agents = build_workload(args)
    builds: dict[str, Path | None] = {"kvgate": None}
    if args.baseline_checkout is not None:
        builds["kvgate@base"] = args.baseline_checkout
    pairs = [(b, m) for b in builds for m in args.modes]
    runs = Runs({pair: [] for pair in pairs}, {b: [] for b in builds})
    shuffle = random.Random(7).shuffle
    with tempfile.TemporaryDirectory() as tmp:
        tok = byte_tokenizer_dir(Path(tmp) / "tokenizer")
        for r in range(args.rounds):
            order = list(pairs)
            shuffle(order)
            for build, mode in order:
                runs.states[build].append(checkout_state(builds[build] or REPO))
                started = time.perf_counter()
                result = await one_run(args, agents, tok, Path(tmp), builds[build], mode)
                runs.rounds[(build, mode)].append(result)
                took = time.perf_counter() - started
                print(f"round {r + 1}/{args.rounds} {build:12s} {mode:9s} {took:5.1f}s "
                      f"hit {result['hit_rate']:.1%} eng/fan {result['engines_per_fanout']:.2f} "
                      f"errors {result['errors']}", file=sys.stderr)  # fmt: skip
    return runs


def summarize(runs: Runs) -> dict[str, Any]:
    """Per build and mode: each figure's median, min and max over the rounds that answered at all (a run
    whose every request failed, e.g. a checkout caught mid-edit, is counted in ``failed_runs`` instead)."""
    out: dict[str, Any] = {}
    for (build, mode), rounds in runs.rounds.items():
        good = [r for r in rounds if r["errors"] < r["requests"]]
        values = {k: [r[k] for r in good if not math.isnan(r[k])] for k in rounds[0]}
        out.setdefault(build, {})[mode] = {
            "median": {k: statistics.median(v) if v else math.nan for k, v in values.items()},
            "min": {k: min(v) if v else math.nan for k, v in values.items()},
            "max": {k: max(v) if v else math.nan for k, v in values.items()},
            "good_runs": len(good),
            "failed_runs": len(rounds) - len(good),
            "rounds": rounds,
        }
    return out


COLUMNS = (  # (header, key, format of one value)
    ("hit all", "hit_rate", "{:.1%}"),
    ("hit t>=2", "hit_rate_turn2plus", "{:.1%}"),
    ("eng/fan", "engines_per_fanout", "{:.2f}"),
    ("1-eng", "one_engine_share", "{:.0%}"),
    ("t>=2 c>0", "turn2plus_cached_share", "{:.0%}"),
    ("TTFT p50 ms", "ttft_p50_s", "ms"),
    ("TTFT p90 ms", "ttft_p90_s", "ms"),
    ("errors", "errors", "{:.0f}"),
)


def cell(fmt: str, value: float) -> str:
    return f"{value * 1e3:.1f}" if fmt == "ms" else fmt.format(value)


def print_table(summary: dict[str, Any], args: argparse.Namespace, when: str) -> None:
    print(
        f"\nagent fan-outs: {args.agents} agents x {args.turns} turns x {args.fanout} parallel calls, "
        f"stream={args.stream}, 4 simulated engines, {args.rounds} interleaved rounds ({when})"
    )
    print("median (min-max over rounds); runs: those that answered / all (one that failed every request")
    print("is left out of the figures)")
    rows = []
    for build, modes in summary.items():
        for mode, s in modes.items():
            rows.append([build, mode, f"{s['good_runs']}/{s['good_runs'] + s['failed_runs']}"] + [
                f"{cell(fmt, s['median'][key])} ({cell(fmt, s['min'][key])}-{cell(fmt, s['max'][key])})"
                for _, key, fmt in COLUMNS
            ])  # fmt: skip
    headers = ["build", "mode", "runs"] + [h for h, _, _ in COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        cells = zip(row, widths, strict=True)
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(cells)))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--fanout", type=int, default=8, help="parallel requests per turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stream", choices=("mix", "on", "off"), default="mix")
    parser.add_argument(
        "--modes", default="affinity,none", help="affinity (x-session-affinity), none, or both"
    )
    parser.add_argument("--system-tokens", type=int, default=1500, help="each agent's own system prompt")
    parser.add_argument("--shared-system-tokens", type=int, default=0, help="a prefix common to all agents")
    parser.add_argument("--task-tokens", type=int, default=200)
    parser.add_argument("--turn-tokens", type=int, default=300, help="what each turn adds to the prefix")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stagger", type=float, default=0.25, help="seconds between agents' starts")
    parser.add_argument("--think", type=float, default=0.4, help="mean seconds between an agent's turns")
    parser.add_argument("--prefill-s", type=float, default=2e-6, help="simulated prefill seconds per token")
    parser.add_argument(
        "--capacity", type=int, default=2000 * 32, help="prefix cache per engine, 16-token blocks"
    )
    parser.add_argument(
        "--baseline-checkout",
        type=Path,
        help="another kvgate checkout (git worktree add DIR COMMIT) run beside this one as kvgate@base",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    if not set(args.modes) <= {"affinity", "none"} or not args.modes:
        parser.error("--modes: affinity, none, or both")
    install_best_loop()
    raise_open_file_limit()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    runs = asyncio.run(run(args))
    when = f"{started} - {time.strftime('%H:%M:%S')}"
    summary = summarize(runs)
    print_table(summary, args, when)
    for build, states in runs.states.items():
        distinct = list(dict.fromkeys(f"{s['head']}+{s['diff']}" for s in states))
        note = "  (CHANGED between runs)" if len(distinct) > 1 else ""
        print(f"{build}: {', '.join(distinct)}{note}")
    if args.json:
        print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "when": when,
                          "checkouts": runs.states, "results": summary}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
