"""``kvgate demo``: simulated engines in several regions on this machine, and a gateway in front of them.

Engines run as separate processes (``python -m engine.sim``): the gateway talks to them over HTTP exactly as
it would to remote ones, and never imports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.app import build_app
from gateway.config import parse_config
from gateway.loop import install_best_loop
from gateway.server import serve_until_signal

REGION_NAMES = ("eu-west", "us-east", "ap-south", "sa-east", "af-south", "me-central", "ap-east", "us-west")
DEMO_MODEL = "kvgate-sim"
INTER_REGION_RTT_MS = 40.0


@dataclass
class EngineProcess:
    region: str
    name: str
    port: int
    process: subprocess.Popen[bytes]

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
    regions: int, engines_per_region: int, extra_args: list[str] | None = None
) -> list[EngineProcess]:
    engines = []
    for region in region_names(regions):
        for i in range(engines_per_region):
            port = free_port()
            cmd = [
                sys.executable, "-m", "engine.sim", "--port", str(port), "--model", DEMO_MODEL,
                "--engine-id", f"{region}/e{i}", *(extra_args or []),
            ]  # fmt: skip
            process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
            engines.append(EngineProcess(region, f"e{i}", port, process))
    return engines


async def wait_healthy(engines: list[EngineProcess], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        for e in engines:
            while True:
                if e.process.poll() is not None:
                    raise RuntimeError(
                        f"engine {e.region}/{e.name} exited with status {e.process.returncode}"
                    )
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(f"{e.url}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"engine {e.region}/{e.name} did not become healthy in {timeout_s:.0f}s"
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


def demo_config(engines: list[EngineProcess], port: int, redis_url: str | None) -> dict[str, Any]:
    names = list(dict.fromkeys(e.region for e in engines))
    return {
        "region": names[0],
        "regions": [
            {
                "name": r,
                "engines": [
                    {"name": e.name, "url": e.url, "model": DEMO_MODEL} for e in engines if e.region == r
                ],
            }
            for r in names
        ],
        "rtt_ms": {f"{a}.{b}": INTER_REGION_RTT_MS for i, a in enumerate(names) for b in names[i + 1 :]},
        "gateway": {"host": "127.0.0.1", "port": port, "redis_url": redis_url},
    }


def tour(port: int) -> str:
    base = f"http://127.0.0.1:{port}"
    stream = '{"model": "kvgate-sim", "stream": true, "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "hello"}]}'  # noqa: E501
    first = '{"model": "kvgate-sim", "messages": [{"role": "system", "content": "You are a terse assistant that answers in one line."}, {"role": "user", "content": "Name three prime numbers."}]}'  # noqa: E501
    return f"""
kvgate demo: a gateway on {base} in front of simulated engines (SIMULATED: the answers are filler text).

Try a conversation with session affinity (run it twice: the second answer reports cached tokens):
  curl -s {base}/v1/chat/completions -H 'content-type: application/json' \\
       -H 'x-session-affinity: demo-chat-1' -d '{first}' -D - | grep -iE '^x-kvgate|cached_tokens|"content"'

Stream it:
  curl -sN {base}/v1/chat/completions -H 'content-type: application/json' \\
       -H 'x-session-affinity: demo-chat-1' -d '{stream}'

Models, health and metrics (the hit ratio is cached_prompt_tokens / prompt_tokens):
  curl -s {base}/v1/models
  curl -s {base}/health
  curl -s {base}/metrics | grep -E '^kvgate_(cached_)?prompt_tokens_total|^kvgate_routing_decisions_total'

Ctrl-C stops the gateway and every engine.
"""


async def _serve(config: dict[str, Any], port: int) -> None:
    app = build_app(parse_config(config, environ=os.environ))
    try:
        await serve_until_signal(app, "127.0.0.1", port, on_ready=lambda: print(tour(port), flush=True))
    finally:
        print("\nkvgate demo: stopping ...", flush=True)


def run_demo(*, port: int, regions: int, engines_per_region: int, redis_url: str | None) -> int:
    install_best_loop()
    engines = start_engines(regions, engines_per_region)
    try:
        asyncio.run(wait_healthy(engines))
        asyncio.run(_serve(demo_config(engines, port, redis_url), port))
    except RuntimeError as exc:
        print(f"kvgate demo: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_engines(engines)
    print("kvgate demo: stopped.", flush=True)
    return 0
