"""Real tiny engines over HTTP for the engine tests (KV transfers, metrics): start one, ask it."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import SamplingParams
from engine.server import ENGINE_SERVER, EngineServer, ServerConfig, build_app
from tests.serving import serve

BS = 4


class Node:
    def __init__(self, server: EngineServer, url: str, runner: web.AppRunner) -> None:
        self.server, self.url, self.runner = server, url, runner


async def start_node(model_dir: Path, role: str, name: str, **config: Any) -> Node:
    options: dict[str, Any] = {"block_size": BS, "num_kv_blocks": 256, "device": "cpu", **config}
    engine = LLMEngine(EngineConfig(str(model_dir), **options))
    app = build_app(engine, ServerConfig(engine_id=name, role=role))
    runner = web.AppRunner(app, handler_cancellation=True)
    return Node(app[ENGINE_SERVER], await serve(runner), runner)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(11 * j + 5 + offset) % 500 + 3 for j in range(n)]


async def complete(
    session: aiohttp.ClientSession, node: Node, ids: list[int], prefill: Node | None = None, **extra: Any
) -> tuple[int, dict[str, Any], Any]:
    body: dict[str, Any] = {
        "model": node.server.model,
        "prompt": "x",
        "prompt_token_ids": ids,
        "max_tokens": 16,
    }
    body.update(extra)
    if prefill is not None:
        body["kv_transfer_params"] = {"prefill_url": prefill.url}
    async with session.post(node.url + "/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None), r.headers


async def engine_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """An engine's ``/metrics`` samples by name and labels, its ``engine`` label left out."""
    async with session.get(url + "/metrics") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvgate_engine_"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r'engine="[^"]*",?', "", name).replace("{}", "")] = float(value)
    return out


def colocated(model_dir: Path, ids: list[int], params: SamplingParams) -> list[int]:
    return LLMEngine(EngineConfig(str(model_dir), block_size=BS, num_kv_blocks=256, device="cpu")).generate(
        [ids], params
    )[0]


async def assert_all_free(node: Node) -> None:
    """Once its requests are done, the engine holds no block (every reservation was given back)."""
    llm = node.server.llm
    for _ in range(100):
        if not llm.scheduler.has_work():
            break
        await asyncio.sleep(0.02)
    assert not llm.scheduler.has_work()
    assert all(b.ref_count == 0 for b in llm.blocks.blocks)
