"""A gateway killed with -9 under load, then restarted: each request an engine took is billed exactly once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from cache.ledger_redis import RedisLedger
from cache.redis_keys import RedisKeys
from engine.sim.server import SimEngineConfig
from engine.sim.server import build_app as build_sim_app
from gateway.demo import free_port
from tests.harness import MODEL, _start

PRICE = 'input = "1.00"\ncached_input = "0.10"\noutput = "2.00"\n'


def recording_engine(engine_id: str, seen: list[str]) -> web.Application:
    """A simulated engine that notes the x-request-id of every completion request it takes."""
    app = build_sim_app(
        SimEngineConfig(engine_id=engine_id, model=MODEL, prefill_s_per_token=0.0, decode_s_per_token=0.01)
    )

    @web.middleware
    async def note(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> Any:
        if request.path.endswith("completions"):
            seen.append(request.headers.get("X-Request-Id", ""))
        return await handler(request)

    app.middlewares.append(note)
    return app


async def start_gateway(command: list[str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(*command, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_up(url: str, process: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            assert process.returncode is None, "the gateway exited"
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("the gateway did not come up")


@pytest.mark.redis
async def test_kill_9_of_a_gateway_under_load_bills_every_request_an_engine_took_exactly_once(
    tmp_path: Path, redis_url: str, redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    seen: list[str] = []
    runners = []
    urls = []
    for i in range(2):
        runner, url = await _start(recording_engine(f"eu-west/e{i}", seen))
        runners.append(runner)
        urls.append(url)
    port = free_port()
    config = tmp_path / "deploy.toml"
    engines = ", ".join(f'{{ name = "e{i}", url = "{u}", model = "{MODEL}" }}' for i, u in enumerate(urls))
    config.write_text(
        f'region = "eu-west"\n[[regions]]\nname = "eu-west"\nengines = [{engines}]\n'
        f'[gateway]\nport = {port}\nredis_url = "{redis_url}"\nredis_prefix = "{redis_keys.prefix}"\n'
        f'spool_path = "{tmp_path / "ledger.spool"}"\nhealth_interval_s = 0.2\n'
        f'[prices."{MODEL}"]\n{PRICE}'
    )
    command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
    url = f"http://127.0.0.1:{port}"
    gateway = await start_gateway(command)
    outcomes: dict[str, tuple[bool, int]] = {}  # request id -> (whole answer received, its completion tokens)
    try:
        await wait_up(url, gateway)

        async def client(worker: int) -> None:
            async with aiohttp.ClientSession() as session:
                for n in range(1000):
                    request_id = f"crash-{worker}-{n}"
                    stream = n % 2 == 0
                    body = {
                        "model": MODEL,
                        "max_tokens": 40 if stream else 8,  # streams of 0.4 s, answers of 0.08 s
                        "stream": stream,
                        "messages": [{"role": "user", "content": f"worker {worker} question {n}"}],
                    }
                    try:
                        async with session.post(
                            url + "/v1/chat/completions", json=body, headers={"x-request-id": request_id}
                        ) as r:
                            data = await r.read()
                    except aiohttp.ClientError:
                        return  # the gateway is gone
                    if r.status == 200 and stream and data.endswith(b"data: [DONE]\n\n"):
                        outcomes[request_id] = (True, data.count(b'"content":"') - 1)
                    elif r.status == 200 and not stream:
                        outcomes[request_id] = (True, orjson.loads(data)["usage"]["completion_tokens"])

        clients = [asyncio.create_task(client(w)) for w in range(16)]
        await asyncio.sleep(2.0)
        gateway.send_signal(signal.SIGKILL)
        await asyncio.wait_for(gateway.wait(), 10)
        await asyncio.gather(*clients)
        # Restarted in place, it bills first what the dead process owed.
        gateway = await start_gateway(command)
        await wait_up(url, gateway)
    finally:
        if gateway.returncode is None:
            gateway.send_signal(signal.SIGTERM)
            await asyncio.wait_for(gateway.wait(), 15)
        for runner in runners:
            await runner.cleanup()
    records = await RedisLedger(redis_client, redis_keys.prefix).records(limit=100_000)
    by_request = {r.request_id: r for r in records}
    taken = set(seen)
    assert len(taken) > 40 and len(outcomes) > 20  # it was under load
    assert len(by_request) == len(records), "a request billed twice"
    assert len({r.record_id for r in records}) == len(records)
    assert not taken - set(by_request), (
        f"requests an engine took but nobody billed: {sorted(taken - set(by_request))}"
    )
    # Nothing billed that no engine took, but a request the process died sending (its journal entry is
    # written just before it leaves): at most one per client, and only ever as an interrupted estimate.
    unsent = [by_request[r] for r in set(by_request) - taken]
    assert len(unsent) <= 16 and all(r.status == "interrupted" for r in unsent), unsent
    for request_id, (whole, completion) in outcomes.items():
        rec = by_request[request_id]
        assert whole and rec.completion_tokens == completion and not rec.estimated, (request_id, rec)
    interrupted = [r for r in records if r.status == "interrupted"]
    assert interrupted and all(
        r.estimated and r.prompt_tokens > 0 and r.cost_picodollars > 0 for r in interrupted
    )
    left = await asyncio.to_thread(lambda: list(tmp_path.glob("ledger.spool.journal.0*")))
    assert not left  # the restarted gateway owes nothing any more
