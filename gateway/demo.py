"""``kvgate demo``: engines in several regions on this machine, and a gateway in front of them.

By default the engines are kvgate's real engine serving a tiny random-weight model (written once into the
user's cache directory); ``--simulated`` (or a machine without torch) runs the simulator instead. Engines
are separate processes (``python -m engine ...``): the gateway talks to them over HTTP exactly as it would
to remote ones, and never imports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cache.parent_death import die_with_parent
from gateway.app import GATEWAY, build_app
from gateway.config import parse_config
from gateway.http.listening import check_can_listen
from gateway.http.loop import install_best_loop, raise_open_file_limit
from gateway.http.server import serve_until_signal
from gateway.tenancy.tenants import create_key
from gateway.user_errors import UserError

REGION_NAMES = ("eu-west", "us-east", "ap-south", "sa-east", "af-south", "me-central", "ap-east", "us-west")
SIM_MODEL = "kvgate-sim"
TINY_MODEL = "kvgate-tiny"
INTER_REGION_RTT_MS = 40.0


@dataclass(frozen=True)
class EngineKind:
    """What the demo's engines run: the command (port and engine id appended), the model id they serve,
    and the model directory whose tokenizer the gateway must hash with (None: the byte tokenizer)."""

    command: tuple[str, ...]
    model: str
    tokenizer: str | None
    label: str


def simulated_engines() -> EngineKind:
    return EngineKind(
        (sys.executable, "-m", "engine", "sim-engine", "--model", SIM_MODEL), SIM_MODEL, None, "SIMULATED"
    )


def real_engines(model_dir: Path, model: str) -> EngineKind:
    command = (
        sys.executable, "-m", "engine", "engine", "--model", str(model_dir), "--served-model-name", model,
        "--threads", "1", "--kv-blocks", "2048", "--dtype", "float32",
    )  # fmt: skip
    return EngineKind(command, model, str(model_dir), f"kvgate's engine (model {model_dir})")


def demo_model_dir() -> Path:
    """Where the demo keeps its tiny random model (made on first use)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvgate" / "models" / "tiny-llama"


def ensure_demo_model() -> Path:
    directory = demo_model_dir()
    if not (directory / "config.json").is_file():
        print(f"kvgate demo: writing a tiny RANDOM-weight model to {directory}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "engine", "make-model", str(directory), "--preset", "tiny", "--force"],
            check=True,
        )
    return directory


def choose_engines(*, simulated: bool, model_dir: str | None) -> EngineKind:
    if simulated:
        return simulated_engines()
    if importlib.util.find_spec("torch") is None:
        print(
            "kvgate demo: torch is not installed, so the engines are SIMULATED "
            "(install kvgate[engine] for the real engine).",
            flush=True,
        )
        return simulated_engines()
    if model_dir is not None:
        check_model_dir(model_dir)
        return real_engines(Path(model_dir), Path(model_dir).resolve().name)
    return real_engines(ensure_demo_model(), TINY_MODEL)


def check_model_dir(model_dir: str) -> None:
    """Refuse, before any engine starts, a --model that is no model directory at all (each engine would
    fail on it)."""
    path = Path(model_dir)
    fix = (
        "give a model directory in Hugging Face layout (config.json, tokenizer.json, *.safetensors), "
        "or leave --model out for a tiny random one"
    )
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise UserError(f"--model {model_dir}: {what}; {fix}", status=2)
    for name in ("config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise UserError(
                f"--model {model_dir}: no {name} there, so no model it can serve; {fix}", status=2
            )


@dataclass
class EngineProcess:
    region: str
    name: str
    port: int
    process: subprocess.Popen[bytes]
    role: str = "both"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def region_names(count: int) -> list[str]:
    return [REGION_NAMES[i] if i < len(REGION_NAMES) else f"region-{i}" for i in range(count)]


def start_engines(
    kind: EngineKind, regions: int, engines_per_region: int, *, pd: bool = False
) -> list[EngineProcess]:
    """``engines_per_region`` engines per region; with ``pd``, one prefill and one decode engine instead."""
    layout = (
        [("p0", "prefill"), ("d0", "decode")]
        if pd
        else [(f"e{i}", "both") for i in range(engines_per_region)]
    )
    engines = []
    for region in region_names(regions):
        for name, role in layout:
            port = free_port()
            cmd = [*kind.command, "--port", str(port), "--engine-id", f"{region}/{name}"]
            if pd:
                cmd += ["--role", role]
            process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
            engines.append(EngineProcess(region, name, port, process, role))
    return engines


async def wait_healthy(engines: list[EngineProcess], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        for e in engines:
            while True:
                if e.process.poll() is not None:
                    raise RuntimeError(
                        f"engine {e.region}/{e.name} exited with status {e.process.returncode} "
                        "(its own error is above)"
                    )
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(f"{e.url}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"engine {e.region}/{e.name} did not become healthy in {timeout_s:.0f}s "
                        "(a busy machine? try --simulated, or fewer --regions / --engines-per-region)"
                    )
                await asyncio.sleep(0.1)


def stop_engines(engines: list[EngineProcess], timeout_s: float = 5.0) -> None:
    for e in engines:
        if e.process.poll() is None:
            e.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for e in engines:
        try:
            e.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            e.process.kill()
            e.process.wait()


DEMO_TENANTS = ("acme", "globex")  # with --auth; acme's key may also read every tenant's usage
# Dollars per million tokens: cached prompt tokens cost a tenth (what makes x-session-affinity worth sending).
DEMO_PRICES = {"input": "0.50", "cached_input": "0.05", "output": "1.50"}


def demo_config(
    engines: list[EngineProcess],
    kind: EngineKind,
    port: int,
    redis_url: str | None,
    *,
    redis_cluster: bool = False,
    auth: bool = False,
) -> dict[str, Any]:
    names = list(dict.fromkeys(e.region for e in engines))
    return {
        "region": names[0],
        "regions": [
            {
                "name": r,
                "engines": [
                    {"name": e.name, "url": e.url, "model": kind.model, "role": e.role}
                    for e in engines
                    if e.region == r
                ],
            }
            for r in names
        ],
        "rtt_ms": {f"{a}.{b}": INTER_REGION_RTT_MS for i, a in enumerate(names) for b in names[i + 1 :]},
        "gateway": {
            "host": "127.0.0.1",
            "port": port,
            "redis_url": redis_url,
            "redis_cluster": redis_cluster,
            "tokenizer": kind.tokenizer,
            "auth": {"enabled": auth},
        },
        "tenants": {name: {"admin": name == DEMO_TENANTS[0]} for name in DEMO_TENANTS} if auth else {},
        "prices": {kind.model: DEMO_PRICES},
    }


def tour(port: int, kind: EngineKind, keys: dict[str, str] | None = None) -> str:
    base = f"http://127.0.0.1:{port}"
    auth = ' -H "Authorization: Bearer $KVGATE_API_KEY"' if keys else ""
    key_lines = ""
    if keys:
        listed = "\n".join(f"  {tenant:8} {key}" for tenant, key in keys.items())
        first_key = next(iter(keys.values()))
        key_lines = f"""
Authentication is on. One API key per demo tenant (shown once; {DEMO_TENANTS[0]}'s may read all usage):
{listed}
  export KVGATE_API_KEY={first_key}
The two tenants never share cached tokens, nor session ids.
"""
    dashboard = f"{base}/dashboard"
    if keys:  # (the public port serves it to admin keys only, which a browser does not send)
        dashboard += (
            "  (admin keys only here: a browser gets 401; gateway.operator_port opens it to browsers)"
        )
    model = json.dumps(kind.model)
    stream = (
        f'{{"model": {model}, "stream": true, "stream_options": {{"include_usage": true}}, "max_tokens": 8, '
        '"messages": [{"role": "user", "content": "hello"}]}'
    )
    first = (
        f'{{"model": {model}, "max_tokens": 12, "messages": [{{"role": "system", "content": "You are a terse '
        'assistant that answers in one line."}, {"role": "user", "content": "Name three prime numbers."}]}'
    )
    return f"""
kvgate demo: a gateway on {base}; its engines run {kind.label}.
The answers are meaningless text (random weights or a simulator); the caching, routing and usage are real.
{key_lines}
Try a conversation with session affinity (run it twice: the second answer reports cached tokens, billed at
a tenth of the input price in usage.cost):
  curl -s {base}/v1/chat/completions -H 'content-type: application/json'{auth} \\
       -H 'x-session-affinity: demo-chat-1' -d '{first}' -D - | grep -iE '^x-kvgate|cached_tokens|cost'

Stream it:
  curl -sN {base}/v1/chat/completions -H 'content-type: application/json'{auth} \\
       -H 'x-session-affinity: demo-chat-1' -d '{stream}'

Today's usage and cost (kvgate usage --url {base} prints every tenant's):
  curl -s {base}/v1/usage{auth}

The dashboard (live hit ratio, latency and load per region and engine), in a browser:
  {dashboard}

Models, health and metrics (the hit ratio is cached_prompt_tokens / prompt_tokens):
  curl -s {base}/v1/models{auth}
  curl -s {base}/health
  curl -s {base}/metrics{auth} | grep -E '^kvgate_((cached_)?prompt_tokens|routing_decisions)_total'

Ctrl-C stops the gateway and every engine.
"""


async def _serve(config: dict[str, Any], kind: EngineKind, port: int) -> None:
    app = build_app(parse_config(config, environ=os.environ))
    keys = None
    if config["gateway"]["auth"]["enabled"]:
        store = app[GATEWAY].billing.keys
        keys = {tenant: (await create_key(store, tenant, "kvgate demo"))[0] for tenant in DEMO_TENANTS}
    try:
        await serve_until_signal(
            app,
            "127.0.0.1",
            port,
            on_ready=lambda: print(tour(port, kind, keys), flush=True),
            port_flag="--port",
        )
    finally:
        print("\nkvgate demo: stopping ...", flush=True)


def run_demo(
    *,
    port: int,
    regions: int,
    engines_per_region: int,
    redis_url: str | None,
    redis_cluster: bool = False,
    simulated: bool = False,
    model_dir: str | None = None,
    pd: bool = False,
    auth: bool = False,
) -> int:
    # A busy port or a bad --model is said now, before engines start (and all fail on it).
    check_can_listen("127.0.0.1", port, port_flag="--port")
    install_best_loop()
    raise_open_file_limit()
    # A SIGTERM before the gateway is up must still run the clean-up below (it stops the engines).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        kind = choose_engines(simulated=simulated, model_dir=model_dir)
    except subprocess.CalledProcessError as exc:
        print(f"kvgate demo: could not write the demo model ({exc})", file=sys.stderr)
        return 1
    if pd and kind.tokenizer is None:
        print(
            "kvgate demo: --pd needs kvgate's engine (simulated engines cannot transfer KV)", file=sys.stderr
        )
        return 2
    engines = start_engines(kind, regions, engines_per_region, pd=pd)
    try:
        asyncio.run(wait_healthy(engines, timeout_s=120.0))
        asyncio.run(
            _serve(
                demo_config(engines, kind, port, redis_url, redis_cluster=redis_cluster, auth=auth),
                kind,
                port,
            )
        )
    except RuntimeError as exc:
        print(f"kvgate demo: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_engines(engines)
    print("kvgate demo: stopped.", flush=True)
    return 0
