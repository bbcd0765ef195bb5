"""kvgate's engine against vLLM's CPU build on this machine: same random checkpoints, same token-id prompts.

Opt-in (it needs vLLM's own venv: ``scripts/test-vllm --venv-only`` makes ``.venv-vllm``, ~12 min, 3.5 GB):

    python tests/bench/bench_engine_vs_vllm.py --vllm-venv .venv-vllm            # everything (35-60 min)
    python tests/bench/bench_engine_vs_vllm.py --vllm-venv .venv-vllm --models h256 --dtypes bfloat16 \\
        --prompt-tokens 2000 --streams 16 --rounds 1                              # a quick subset (~5 min)
    python tests/bench/bench_engine_vs_vllm.py --kvgate-only ...                  # no vLLM at all

Checkpoints (random weights, written by ``engine.make_model``, float32 on disk, served in each --dtype):
``h256`` (hidden 256, 2 layers, 4 heads of dim 64, 2 KV heads: vLLM's CPU attention wants head_dim >= 32)
and ``small`` (make_model's 88M preset: hidden 768, 12 layers, head_dim 64).

For each model and dtype, ``--rounds`` rounds; a round starts ONE engine at a time (a fresh process, so its
prefix cache is empty), in the order kvgate, vLLM, then vLLM, kvgate in the next round, and so on. Each
engine gets the same flags where both have them: block size 32, prefix caching, ``--max-num-seqs`` = the
largest stream count, the same token budget per step (``--max-batched-tokens``, default 2048: vLLM's CPU
default and kvgate's), the same KV cache size (``--kv-gib``: kvgate's ``--kv-memory-gib``, vLLM's
``VLLM_CPU_KVCACHE_SPACE``). vLLM runs with its defaults otherwise: it compiles the model with inductor on
CPU, and on 2 cores its auto binding gives the model one OpenMP thread and keeps the other core for its
API server (``VLLM_CPU_OMP_THREADS_BIND`` in the environment overrides that). ``--vllm-arg=FLAG`` and
``--kvgate-arg=FLAG`` add flags (``--vllm-arg=--enforce-eager``: vLLM without torch.compile). Every engine
answers a short warm-up first (a 512-token prompt, then a small batch), which is not measured. Then, over
streaming ``/v1/completions`` (``ignore_eos``, greedy, prompt as token ids, the same prompts on both sides
in a round):

* cold TTFT: a new prompt of each ``--prompt-tokens`` length (none of it cached), ``max_tokens`` 1, so the
  first SSE event comes with the first token whatever its text;
* cached TTFT: the same prompt again (its whole blocks are in the cache: ``cached_tokens`` is reported);
* decode: ``--streams`` concurrent requests of 128-token prompts x ``--new-tokens`` (64) tokens: output
  tokens per second over the wall time from the first request sent to the last token, and their TTFT p50.

Each figure is printed as the median over rounds with its range, and kvgate/vLLM: for TTFT lower is
better, for tok/s higher is better; the last column names the winner. ``--json FILE`` writes every sample.
Engines are stopped (their whole process group) on any exit; a start that fails or takes longer than
``--start-timeout`` shows the end of the engine's log.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODELS = ("h256", "small")
DECODE_PROMPT_TOKENS = 128
WARMUP_PROMPT_TOKENS = 512
SERVED = "bench"


# -- checkpoints -----------------------------------------------------------------------------------


def build_model(directory: Path, name: str) -> Path:
    """The random checkpoint ``name`` in ``directory/name`` (written once, then reused)."""
    out = directory / name
    if (out / "config.json").is_file():
        return out
    sys.path.insert(0, str(REPO))
    from engine import make_model as mm

    if name == "h256":
        mm.PRESETS[name] = mm.Preset(
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=1024,
            vocab_size=16_384,
            corpus_lines=20_000,
            max_position_embeddings=16_384,
            tie_word_embeddings=True,
        )
    started = time.perf_counter()
    mm.make_model(out, name, arch="llama", seed=0, dtype="float32")
    say(f"wrote the random {name} checkpoint in {time.perf_counter() - started:.0f} s")
    return out


def model_limits(model_dir: Path) -> tuple[int, int]:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config["vocab_size"]), int(config["max_position_embeddings"])


def token_ids(seed: str, n: int, vocab: int) -> list[int]:
    """``n`` token ids drawn from ``seed`` (clear of the special tokens at the ends of the vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(16, vocab - 16) for _ in range(n)]


# -- engines ---------------------------------------------------------------------------------------

RUNNING: list[subprocess.Popen[bytes]] = []


def stop(proc: subprocess.Popen[bytes]) -> None:
    """TERM the engine's process group (API server, engine core, workers), KILL it after 20 s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)
    if proc in RUNNING:
        RUNNING.remove(proc)


def stop_all() -> None:
    for proc in list(RUNNING):
        stop(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Settings:
    kvgate_python: str
    kvgate_src: Path
    vllm_python: str | None
    kv_gib: int
    max_num_seqs: int
    max_batched_tokens: int
    start_timeout: float
    request_timeout: float
    vllm_args: list[str]
    kvgate_args: list[str]
    logs: Path


def engine_command(engine: str, model: Path, dtype: str, port: int, max_len: int, s: Settings) -> list[str]:
    common = ["--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port)]
    common += ["--dtype", dtype, "--block-size", "32", "--max-model-len", str(max_len)]
    common += ["--max-num-seqs", str(s.max_num_seqs)]
    if engine == "kvgate":
        return [
            s.kvgate_python, "-m", "engine", "engine", "--model", str(model), *common, "--device", "cpu",
            "--kv-memory-gib", str(s.kv_gib), "--max-batched-tokens", str(s.max_batched_tokens),
            *s.kvgate_args,
        ]  # fmt: skip
    assert s.vllm_python is not None
    return [
        s.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *common,
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--max-num-batched-tokens", str(s.max_batched_tokens), *s.vllm_args,
    ]  # fmt: skip


def engine_env(engine: str, s: Settings) -> dict[str, str]:
    env = dict(os.environ)
    if engine == "vllm":  # THIRD_PARTY_ENGINES.md: how vLLM's CPU build runs here
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=str(s.kv_gib),
            VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(s.kvgate_src), env.get("PYTHONPATH", "")) if p)
    return env


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_engine(
    engine: str, model: Path, dtype: str, max_len: int, s: Settings, tag: str
) -> tuple[subprocess.Popen[bytes], str, float]:
    """Start one engine and wait for /health; -> (process, base URL, seconds to healthy)."""
    port = free_port()
    log = s.logs / f"{tag}.log"
    cmd = engine_command(engine, model, dtype, port, max_len, s)
    with log.open("wb") as out:
        out.write((" ".join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=engine_env(engine, s),
            cwd=s.kvgate_src if engine == "kvgate" else REPO, start_new_session=True,
        )  # fmt: skip
    RUNNING.append(proc)
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    while True:
        if proc.poll() is not None:
            stop(proc)
            raise BenchError(
                f"{engine} exited during start-up (status {proc.returncode}); {log}:\n{tail(log)}"
            )
        if time.perf_counter() - started > s.start_timeout:
            stop(proc)
            raise BenchError(
                f"{engine} did not answer /health within {s.start_timeout:.0f} s; {log}:\n{tail(log)}"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return proc, url, time.perf_counter() - started
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)


class BenchError(Exception):
    pass


# -- requests --------------------------------------------------------------------------------------


@dataclass
class Answer:
    ttft: float
    total: float
    completion_tokens: int
    cached_tokens: int | None


async def complete(session: Any, url: str, prompt: list[int], max_tokens: int, limit_s: float) -> Answer:
    """One streaming /v1/completions request; TTFT is the first SSE event that carries a choice."""
    import aiohttp

    body = {
        "model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async with session.post(
        url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=limit_s)
    ) as resp:
        if resp.status != 200:
            raise BenchError(f"{url}: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise BenchError(f"{url}: error in the stream: {chunk['error']}")
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    total = time.perf_counter() - start
    if ttft is None or not usage:
        raise BenchError(f"{url}: the stream ended without a token or without usage")
    details = usage.get("prompt_tokens_details") or {}
    return Answer(ttft, total, int(usage["completion_tokens"]), details.get("cached_tokens"))


async def measure(url: str, round_seed: str, vocab: int, args: argparse.Namespace) -> dict[str, float]:
    """Warm up, then every figure of one engine in one round."""
    import aiohttp

    out: dict[str, float] = {}
    timeout = args.request_timeout
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        # Warm-up (not measured): a prompt, then a small batch, with ids no later prompt shares.
        await complete(session, url, token_ids(f"warm-{round_seed}", WARMUP_PROMPT_TOKENS, vocab), 8, timeout)
        await asyncio.gather(
            *(
                complete(session, url, token_ids(f"warm-{round_seed}-{i}", 64, vocab), 8, timeout)
                for i in range(4)
            )
        )
        for n in args.prompt_tokens:
            prompt = token_ids(f"cold-{round_seed}-{n}", n, vocab)
            cold = await complete(session, url, prompt, 1, timeout)
            cached = await complete(session, url, prompt, 1, timeout)
            out[f"cold TTFT {n} (s)"] = cold.ttft
            out[f"cached TTFT {n} (s)"] = cached.ttft
            if cached.cached_tokens is not None:
                out[f"cached tokens {n}"] = cached.cached_tokens
            say(
                f"    {n}-token prompt: cold {cold.ttft:.3f} s, cached {cached.ttft:.3f} s "
                f"({cached.cached_tokens} cached)"
            )
        for streams in args.streams:
            prompts = [
                token_ids(f"dec-{round_seed}-{streams}-{i}", DECODE_PROMPT_TOKENS, vocab)
                for i in range(streams)
            ]
            start = time.perf_counter()
            answers = await asyncio.gather(
                *(complete(session, url, p, args.new_tokens, timeout) for p in prompts)
            )
            wall = time.perf_counter() - start
            produced = sum(a.completion_tokens for a in answers)
            if produced != streams * args.new_tokens:
                raise BenchError(f"{url}: {produced} tokens from {streams} x {args.new_tokens} (ignore_eos?)")
            out[f"{streams} streams tok/s"] = produced / wall
            out[f"{streams} streams TTFT p50 (s)"] = statistics.median(a.ttft for a in answers)
            say(f"    {streams} streams x {args.new_tokens}: {produced / wall:.1f} tok/s in {wall:.1f} s")
    return out


# -- report ----------------------------------------------------------------------------------------


@dataclass
class Cell:
    samples: dict[str, list[float]] = field(default_factory=lambda: {"kvgate": [], "vllm": []})


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    fmt = "{:.0f}" if all(float(v).is_integer() for v in values) else "{:.3f}"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def report(title: str, table: dict[str, Cell]) -> str:
    lines = [title, f"  {'figure':<28} {'kvgate':>26} {'vLLM':>26} {'kvgate/vLLM':>12}  better"]
    for metric, cell in table.items():
        k, v = cell.samples["kvgate"], cell.samples["vllm"]
        ratio, better = "-", ""
        if k and v and statistics.median(v) > 0 and "cached tokens" not in metric:
            r = statistics.median(k) / statistics.median(v)
            ratio = f"{r:.2f}"
            higher_better = "tok/s" in metric
            better = "kvgate" if (r > 1) == higher_better and r != 1 else ("vLLM" if r != 1 else "tie")
        lines.append(f"  {metric:<28} {spread(k):>26} {spread(v):>26} {ratio:>12}  {better}")
    lines.append(
        "  (TTFT in seconds, lower is better; tok/s higher is better; medians over rounds [min-max])"
    )
    return "\n".join(lines)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- main ------------------------------------------------------------------------------------------


def csv(kind: type, choices: tuple[str, ...] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        values = [kind(v) for v in text.split(",") if v]
        if choices is not None and not set(values) <= set(choices):
            raise argparse.ArgumentTypeError(f"pick from {', '.join(choices)}")
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return values

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--vllm-venv", type=Path, help="vLLM's venv (scripts/test-vllm --venv-only makes .venv-vllm)"
    )
    p.add_argument("--kvgate-only", action="store_true", help="measure kvgate alone (no vLLM needed)")
    p.add_argument("--models", type=csv(str, MODELS), default=list(MODELS), help="h256,small (default: both)")
    p.add_argument(
        "--dtypes",
        type=csv(str, ("float32", "bfloat16")),
        default=["float32", "bfloat16"],
        help="float32,bfloat16 (default: both)",
    )
    p.add_argument(
        "--prompt-tokens", type=csv(int), default=[2000, 4000, 8000], help="default: 2000,4000,8000"
    )
    p.add_argument(
        "--streams", type=csv(int), default=[16, 64], help="concurrent decode streams (default: 16,64)"
    )
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per decode stream (default: 64)")
    p.add_argument("--rounds", type=int, default=2, help="fresh starts of each engine (default: 2)")
    p.add_argument("--kv-gib", type=int, default=2, help="KV cache GiB, both engines (default: 2)")
    p.add_argument(
        "--max-batched-tokens", type=int, default=2048, help="token budget per step (default: 2048)"
    )
    p.add_argument("--start-timeout", type=float, default=600, help="seconds to /health (default: 600)")
    p.add_argument("--request-timeout", type=float, default=1800, help="seconds per request (default: 1800)")
    p.add_argument(
        "--models-dir", type=Path, help="keep (and reuse) the checkpoints here (default: temporary)"
    )
    p.add_argument("--logs", type=Path, help="write the engines' logs here (default: temporary, removed)")
    p.add_argument("--vllm-arg", action="append", default=[], help="one more vLLM flag (repeatable)")
    p.add_argument(
        "--kvgate-arg", action="append", default=[], help="one more kvgate engine flag (repeatable)"
    )
    p.add_argument("--json", type=Path, help="write every sample here")
    p.add_argument(
        "--kvgate-src",
        type=Path,
        help="run kvgate's engine from this source tree, e.g. a `git worktree` of another commit "
        "(default: this checkout)",
    )
    args = p.parse_args(argv)
    if not args.kvgate_only:
        if args.vllm_venv is None:
            p.error(
                "--vllm-venv DIR is needed (scripts/test-vllm --venv-only makes .venv-vllm), or --kvgate-only"
            )
        vpy = args.vllm_venv / "bin" / "python"
        if not vpy.exists():
            p.error(f"{vpy} does not exist: run scripts/test-vllm --venv-only (or give --kvgate-only)")
        check = subprocess.run(
            [str(vpy), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            p.error(f"{vpy} has no vllm-cpu: run scripts/test-vllm --venv-only\n{check.stderr[-500:]}")
        args.vllm_version = check.stdout.strip()
    if args.rounds < 1 or args.new_tokens < 1 or min(args.streams) < 1 or min(args.prompt_tokens) < 1:
        p.error("--rounds, --new-tokens, --streams and --prompt-tokens must be positive")
    return args


def machine_line(args: argparse.Namespace) -> str:
    """What the figures depend on: the CPU's bf16 support, the core count, the load, vLLM's version."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have)
                break
    vllm = "not run" if args.kvgate_only else f"vllm-cpu {args.vllm_version}"
    return f"{os.cpu_count()} cores ({flags}), load {os.getloadavg()[0]:.1f}, {vllm}"


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    logs = args.logs or work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    vpy = None if args.kvgate_only else str((args.vllm_venv / "bin" / "python").absolute())
    settings = Settings(
        kvgate_python=sys.executable,
        kvgate_src=(args.kvgate_src or REPO).absolute(),
        vllm_python=vpy,
        kv_gib=args.kv_gib,
        max_num_seqs=max(args.streams),
        max_batched_tokens=args.max_batched_tokens,
        start_timeout=args.start_timeout,
        request_timeout=args.request_timeout,
        vllm_args=args.vllm_arg,
        kvgate_args=args.kvgate_arg,
        logs=logs,
    )
    engines = ["kvgate"] if args.kvgate_only else ["kvgate", "vllm"]
    say(machine_line(args))
    results: dict[str, Any] = {}
    reports = []
    for name in args.models:
        model = build_model(args.models_dir or work / "models", name)
        vocab, max_pos = model_limits(model)
        need = max(args.prompt_tokens) + max(args.new_tokens, 1)
        if need > max_pos:
            raise BenchError(
                f"{name}: a {max(args.prompt_tokens)}-token prompt + {args.new_tokens} tokens exceed its "
                f"{max_pos} positions"
            )
        max_len = min(max_pos, max(need, 8192))
        for dtype in args.dtypes:
            table: dict[str, Cell] = {}
            starts: dict[str, list[float]] = {e: [] for e in engines}
            for r in range(args.rounds):
                order = engines if r % 2 == 0 else engines[::-1]
                for engine in order:
                    tag = f"{name}-{dtype}-r{r}-{engine}"
                    say(f"[{tag}] starting")
                    proc, url, up = start_engine(engine, model, dtype, max_len, settings, tag)
                    starts[engine].append(up)
                    say(f"[{tag}] healthy after {up:.0f} s")
                    try:
                        figures = asyncio.run(measure(url, f"{name}-{r}", vocab, args))
                    except Exception as exc:  # a refused request, a dropped connection, a timeout
                        text = str(exc) if isinstance(exc, BenchError) else f"{type(exc).__name__}: {exc}"
                        raise BenchError(
                            f"{tag}: {text}\n{tag}'s log:\n{tail(logs / (tag + '.log'))}"
                        ) from None
                    finally:
                        stop(proc)
                    for metric, value in figures.items():
                        table.setdefault(metric, Cell()).samples[engine].append(value)
            key = f"{name} {dtype}"
            results[key] = {m: c.samples for m, c in table.items()} | {"start_s": starts}
            text = report(f"== {key}: {args.rounds} round(s)", table)
            say(text)
            reports.append(text)
    print("\n\n".join(reports))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="kvgate-vs-vllm-") as tmp:
        try:
            results = run(args, Path(tmp))
        except BenchError as exc:
            say(f"bench_engine_vs_vllm: {exc}")
            return 1
        except KeyboardInterrupt:
            say("bench_engine_vs_vllm: interrupted")
            return 130
        finally:
            stop_all()
    if args.json:
        meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        body = {"machine": machine_line(args), "args": meta, "results": results}
        args.json.write_text(json.dumps(body, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
