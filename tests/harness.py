"""A real cluster in one event loop: simulated engines and gateways on free ports, talking over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from engine.llm_engine import EngineConfig, LLMEngine
from engine.server import ENGINE_SERVER, ServerConfig
from engine.server import build_app as build_engine_app
from engine.sim.server import SIM_ENGINE, SimEngine, SimEngineConfig
from engine.sim.server import build_app as build_sim_app
from gateway.app import GATEWAY, build_app
from gateway.config import parse_config
from gateway.http.server import runner_for
from gateway.service import Gateway
from tests.redis_prefixes import REDIS_URL, new_prefix
from tests.serving import serve

FAST_SIM = {"prefill_s_per_token": 0.0, "decode_s_per_token": 0.0005}
MODEL = "kvgate-sim"


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = runner_for(app)
    return runner, await serve(runner)


@dataclass
class Cluster:
    engines: dict[str, tuple[Any, str]]  # engine id ("region/name") -> (SimEngine or EngineServer, url)
    model: str = MODEL
    roles: dict[str, str] = field(default_factory=dict)  # engine id -> prefill | decode (default both)
    gateways: list[tuple[Gateway, str]] = field(default_factory=list)
    session: aiohttp.ClientSession | None = None
    engine_runners: dict[str, web.AppRunner] = field(default_factory=dict)
    # The key prefix its gateways use in Redis unless a test names its own (never the default ``kvgate``):
    # keys under it in the tests' Redis are deleted when the cluster closes.
    redis_prefix: str = field(default_factory=new_prefix)
    _runners: list[web.AppRunner] = field(default_factory=list)
    _shared_prefixes: set[str] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.gateways[0][1]

    @property
    def gateway(self) -> Gateway:
        return self.gateways[0][0]

    def sim(self, engine_id: str) -> SimEngine:
        return self.engines[engine_id][0]

    async def add_gateway(self, region: str, **gateway: Any) -> tuple[Gateway, str]:
        regions: dict[str, list[dict[str, Any]]] = {}
        extra = gateway.pop("engine_options", {})
        tables = {k: gateway.pop(k) for k in ("tenants", "prices") if k in gateway}
        for engine_id, (_, url) in self.engines.items():
            r, name = engine_id.split("/")
            regions.setdefault(r, []).append(
                {
                    "name": name,
                    "url": url,
                    "model": self.model,
                    "role": self.roles.get(engine_id, "both"),
                    **extra.get(engine_id, {}),
                }
            )
        gateway_id = f"gw-{uuid.uuid4().hex[:6]}"
        # A spool of its own per test gateway (only written while the ledger's Redis is away), in the
        # session's temporary state directory (tests/conftest.py sets XDG_STATE_HOME).
        spools = Path(os.environ.get("XDG_STATE_HOME") or tempfile.gettempdir()) / "kvgate-test-spools"
        settings = {
            "health_interval_s": 0.05,
            "gateway_id": gateway_id,
            "spool_path": str(spools / f"{gateway_id}.spool"),
            "redis_prefix": self.redis_prefix,
            **gateway,
        }
        if settings.get("redis_url") == REDIS_URL:
            self._shared_prefixes.add(settings["redis_prefix"])
        config = parse_config(
            {
                "region": region,
                "regions": [{"name": r, "engines": es} for r, es in regions.items()],
                "rtt_ms": {f"{a}.{b}": 40 for a in regions for b in regions if a < b},
                "gateway": settings,
                **tables,
            }
        )
        app = build_app(config)
        runner, url = await _start(app)
        self._runners.append(runner)
        entry = (app[GATEWAY], url)
        self.gateways.append(entry)
        return entry

    async def post(
        self, path: str, body: Any, *, url: str | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, Any]:
        assert self.session is not None
        async with self.session.post((url or self.url) + path, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None), r.headers

    async def wait_for(self, predicate: Callable[[], bool], within_s: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + within_s
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError("condition not reached in time")
            await asyncio.sleep(0.02)

    async def stop_engine(self, engine_id: str) -> None:
        """Shut one engine down (its port then refuses connections)."""
        await self.engine_runners.pop(engine_id).cleanup()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        for runner in [*reversed(self._runners), *self.engine_runners.values()]:
            await runner.cleanup()
        if self._shared_prefixes:  # the gateways are gone: nothing writes under their prefixes any more
            client = aioredis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=5)
            with contextlib.suppress(OSError, aioredis.RedisError):
                for prefix in self._shared_prefixes:
                    keys = [k async for k in client.scan_iter(match=f"*{prefix}*", count=1000)]
                    if keys:
                        await client.delete(*keys)
            await client.aclose()


ClusterFactory = Callable[..., Awaitable[Cluster]]


async def start_cluster(
    regions: dict[str, int] | None = None,
    *,
    sim: dict[str, Any] | None = None,
    real_model: Path | None = None,
    roles: dict[str, str] | None = None,
    gateway_region: str | None = None,
    extra_engines: dict[str, web.Application] | None = None,
    **gateway: Any,
) -> Cluster:
    """Engines per region (``{"eu-west": 2}``) and one gateway in front of them: simulated engines, or
    kvgate's real engine serving ``real_model`` (a model directory)."""
    regions = regions or {"eu-west": 2, "us-east": 2}
    cluster = Cluster(engines={}, roles=roles or {})
    if real_model is not None:
        cluster.model = real_model.name
    try:
        for region, count in regions.items():
            for i in range(count):
                engine_id = f"{region}/e{i}"
                if real_model is None:
                    app = build_sim_app(
                        SimEngineConfig(engine_id=engine_id, model=MODEL, **{**FAST_SIM, **(sim or {})})
                    )
                    handle: Any = app[SIM_ENGINE]
                else:
                    llm = LLMEngine(EngineConfig(str(real_model), num_kv_blocks=256, device="cpu"))
                    role = cluster.roles.get(engine_id, "both")
                    app = build_engine_app(llm, ServerConfig(engine_id=engine_id, role=role))
                    handle = app[ENGINE_SERVER]
                runner, url = await _start(app)
                cluster.engine_runners[engine_id] = runner
                cluster.engines[engine_id] = (handle, url)
        for engine_id, app in (extra_engines or {}).items():  # e.g. tests/faulty_engines.py
            runner, url = await _start(app)
            cluster.engine_runners[engine_id] = runner
            cluster.engines[engine_id] = (app, url)
        cluster.session = aiohttp.ClientSession()
        await cluster.add_gateway(gateway_region or next(iter(regions)), **gateway)
    except BaseException:
        await cluster.close()
        raise
    return cluster
