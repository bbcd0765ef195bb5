"""The health poller per engine kind, against real HTTP servers on 127.0.0.1 that answer as vLLM 0.32, SGLang
and a plain OpenAI server do: what it discovers (model, block size, load), the contradictions it reports
(a model the engine does not serve, a block size other than the engine's, prefix caching off) and what it
tolerates (an unreadable ``/metrics``). Also gateway.http.engine_probe.check_tokenizer against a vLLM-like
``/tokenize``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from cache.chat_template import render_messages
from cache.tokens import Tokenizer, load_tokenizer
from gateway.http.engine_probe import SAMPLE_PROMPT, check_tokenizer
from gateway.observability.metrics import GatewayMetrics
from region_map.config import parse_topology
from region_map.discovery import EngineMetrics
from region_map.fleet import Fleet
from region_map.health import HealthPoller
from tests.serving import serve

HEALTH_LOG = "kvgate.health"


def card(model_id: str, parent: str | None = None) -> dict[str, Any]:
    """A /v1/models entry as vLLM writes it (vllm/entrypoints/openai/models/serving.py)."""
    return {"id": model_id, "object": "model", "created": 1796131026, "owned_by": "vllm",
            "root": f"/models/{model_id}", "parent": parent, "max_model_len": 2048,
            "permission": []}  # fmt: skip


class StockEngine:
    """An HTTP server that answers as a stock engine of ``kind`` does, with answers a test may change."""

    def __init__(self, kind: str, models: list[str]) -> None:
        self.kind = kind
        self.cards = [card(m) for m in models]
        self.health_status = 200
        self.models_status = 200
        self.metrics_status = (
            200 if kind == "vllm" else 404
        )  # SGLang serves /metrics only with --enable-metrics
        self.running, self.waiting, self.kv_usage = 0, 0, 0.0
        self.block_size, self.prefix_caching, self.num_gpu_blocks = 16, True, 1000
        # SGLang: its server arguments on /server_info (or only /get_server_info before late 2025).
        self.server_info: dict[str, Any] = {
            "page_size": 1,
            "disable_radix_cache": False,
            "max_running_requests": None,
        }
        self.server_info_path = "/server_info"
        self.metrics_body: bytes | None = None  # sent as text/plain without a charset instead of the gauges
        self.tokenize: Callable[[dict[str, Any]], Awaitable[web.Response]] | None = None
        self.hits: Counter[str] = Counter()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> StockEngine:
        app = web.Application(middlewares=[self._count])
        if self.kind != "openai":  # an OpenAI server promises no /health
            app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        if self.kind in ("vllm", "sglang"):
            app.router.add_get("/metrics", self._metrics)
        if self.kind == "sglang":
            app.router.add_get(self.server_info_path, self._server_info)
        if self.kind == "vllm":
            app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.05)
        self.url = await serve(self._runner)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _count(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        self.hits[request.path] += 1
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)  # vLLM and SGLang: an empty body

    async def _models(self, request: web.Request) -> web.Response:
        if self.models_status != 200:
            return web.json_response({"error": {"message": "unavailable"}}, status=self.models_status)
        return web.json_response({"object": "list", "data": self.cards})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="Internal Server Error")
        if self.metrics_body is not None:
            return web.Response(body=self.metrics_body, headers={"Content-Type": "text/plain"})
        return web.Response(body=self._metrics_text(), content_type="text/plain", charset="utf-8")

    def _metrics_text(self) -> bytes:
        """Written with prometheus_client as the engines write theirs, under their names and labels
        (vLLM: vllm/v1/metrics/loggers.py; SGLang: srt/metrics/collector.py, scheduler_metrics_mixin.py)."""
        registry = CollectorRegistry()
        model = self.cards[0]["id"]
        if self.kind == "vllm":
            labels = {"model_name": model, "engine": "0"}
            gauges = [
                ("vllm:num_requests_running", self.running),
                ("vllm:num_requests_waiting", self.waiting),
                ("vllm:kv_cache_usage_perc", self.kv_usage),
            ]
            # CacheConfig.metrics_info() (a few of its keys) plus "engine": vllm/v1/metrics/loggers.py.
            info = {"block_size": str(self.block_size), "enable_prefix_caching": str(self.prefix_caching),
                    "prefix_caching_hash_algo": "sha256", "num_gpu_blocks": str(self.num_gpu_blocks),
                    "hash_block_size": "None", "engine": "0"}  # fmt: skip
            doc = "Information of the LLMEngine CacheConfig"
            Gauge("vllm:cache_config_info", doc, list(info), registry=registry).labels(**info).set(1)
        else:
            labels = {"model_name": model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
            gauges = [
                ("sglang:num_running_reqs", self.running),
                ("sglang:num_queue_reqs", self.waiting),
                ("sglang:token_usage", self.kv_usage),
            ]
        for name, value in gauges:
            Gauge(name, name, list(labels), registry=registry).labels(**labels).set(value)
        return generate_latest(registry)

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.cards[0]["id"], **self.server_info, "version": "0.5.9"})

    async def _tokenize(self, request: web.Request) -> web.Response:
        if self.tokenize is None:
            raise web.HTTPNotFound()  # {"detail": "Not Found"} in FastAPI; any 404 without an "error" object
        return await self.tokenize(await request.json())


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[StockEngine]]]:
    started: list[StockEngine] = []

    async def start(kind: str, models: list[str], **attrs: Any) -> StockEngine:
        engine = StockEngine(kind, models)
        for name, value in attrs.items():
            setattr(engine, name, value)
        started.append(await engine.start())
        return engine

    yield start
    for engine in started:
        await engine.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def fleet_of(*engines: dict[str, Any]) -> Fleet:
    return Fleet(parse_topology({"region": "r", "regions": [{"name": "r", "engines": list(engines)}]}))


def logged(caplog: pytest.LogCaptureFixture, level: int, text: str) -> int:
    return sum(1 for r in caplog.records if r.levelno == level and text in r.getMessage())


async def test_a_vllm_engine_is_discovered_model_block_size_and_load(
    engines: Callable[..., Awaitable[StockEngine]], session: aiohttp.ClientSession
) -> None:
    vllm = await engines("vllm", ["probe-a"], block_size=64, running=4, waiting=12, kv_usage=0.25)
    fleet = fleet_of({"name": "v", "url": vllm.url, "kind": "vllm"})
    poller = HealthPoller(fleet, session)
    await poller.probe_all()
    e = fleet.engines["r/v"]
    assert e.healthy and e.last_error is None
    assert e.model == "probe-a" and fleet.serving("probe-a") == [e]
    assert (e.block_size, e.block_size_source) == (64, "engine")
    assert (e.load.running, e.load.waiting, e.load.kv_usage) == (4, 12, 0.25)
    assert (e.load.kv_blocks_used, e.load.kv_blocks_free) == (250, 750)  # 0.25 of num_gpu_blocks
    assert e.queue_estimate() == (16, 12)
    d = e.describe()
    assert (d["kind"], d["block_size"], d["block_size_source"], d["prefix_caching"]) == (
        "vllm",
        64,
        "engine",
        True,
    )
    assert d["served_models"] == ["probe-a"]
    assert d["load"]["source"] == "engine" and d["load"]["kv_usage"] == 0.25
    vllm.running, vllm.waiting = 1, 0  # the load is read every poll
    await poller.probe_all()
    assert e.queue_estimate() == (1, 0)


def test_a_queue_waits_for_room_unless_the_engine_reports_a_free_slot_and_kv_for_the_queued_tokens() -> None:
    fleet = fleet_of(
        {"name": "k", "url": "http://127.0.0.1:9", "block_size": 16},
        {"name": "v", "url": "http://127.0.0.1:10", "kind": "vllm"},
    )
    k, v = fleet.engines["r/k"], fleet.engines["r/v"]
    assert k.waits_for_room(0)  # nothing reported: the guard counts its queue
    load = {"running": 2, "waiting": 9, "waiting_tokens": 4_000, "max_running": 4, "kv_blocks_free": 300}
    k.apply_health({"status": "ok", "load": load})
    # 2 of 4 slots taken, 300 x 16 = 4,800 free KV tokens: its 9 requests wait for prefill budget.
    assert not k.waits_for_room(4_000) and not k.waits_for_room(4_800)
    assert k.waits_for_room(4_801)  # the queued prompts do not all fit: some wait for KV memory
    k.inflight = 5  # more sent here than it has slots (since its last report)
    assert k.waits_for_room(0)
    k.inflight = 0
    k.apply_health({"status": "ok", "load": load | {"running": 4}})  # every slot taken
    assert k.waits_for_room(0)
    k.apply_health({"status": "ok", "load": {"running": 2, "waiting": 9, "max_running": 4}})  # KV not said
    assert k.waits_for_room(0)
    # Free slots and KV, but its queued tokens not said: the 9 waiting prompts (other gateways' among them)
    # are priced by nothing, and the guard counts them.
    k.apply_health({"status": "ok", "load": load | {"waiting_tokens": 0}})
    assert k.waits_for_room(0) and k.waits_for_room(4_000)
    # Its blocks are counted in its own size: configured 16, reporting 32, its 300 free blocks hold 9,600.
    k.apply_health({"status": "ok", "block_size": 32, "load": load})
    assert (k.block_size, k.block_size_source) == (16, "config")
    assert not k.waits_for_room(9_600) and k.waits_for_room(9_601)
    # vLLM's metrics give its free KV but no slot limit: its queue is counted.
    v.apply_metrics(
        EngineMetrics(running=1, waiting=9, kv_usage=0.1, block_size=16, kv_capacity_blocks=1_000)
    )
    assert v.load.kv_blocks_free == 900 and v.waits_for_room(0)


async def test_a_configured_model_the_engine_does_not_list_makes_it_unhealthy_at_once(
    engines: Callable[..., Awaitable[StockEngine]],
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=HEALTH_LOG)
    vllm = await engines("vllm", ["probe-a", "probe-b"])
    fleet = fleet_of({"name": "v", "url": vllm.url, "kind": "vllm", "model": "llama"})
    poller = HealthPoller(fleet, session, unhealthy_after=3)
    e = fleet.engines["r/v"]
    for _ in range(3):
        assert not await poller.probe(e)
        assert not e.healthy
        assert e.last_error == "serves probe-a, probe-b, not llama (the configured model)"
    assert logged(caplog, logging.ERROR, "serves probe-a, probe-b, not llama (the configured model)") == 1
    assert vllm.hits["/v1/models"] == 3  # an unhealthy engine is asked again every poll
    vllm.cards = [card("llama")]  # the operator restarts it with the right model
    assert await poller.probe(e)
    assert e.healthy and e.last_error is None and fleet.serving("llama") == [e]
    # Restarted once more (one failed check: still healthy), now with another model: unhealthy at the first
    # poll that sees it, not after unhealthy_after of them, since every request would 404 there.
    vllm.health_status = 503
    assert not await poller.probe(e) and e.healthy
    vllm.health_status, vllm.cards = 200, [card("probe-a")]
    assert not await poller.probe(e)
    assert not e.healthy and e.last_error == "serves probe-a, not llama (the configured model)"
    assert logged(caplog, logging.ERROR, "serves probe-a, not llama (the configured model)") == 1


async def test_the_engines_block_size_wins_over_the_configured_one_with_a_warning(
    engines: Callable[..., Awaitable[StockEngine]],
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=HEALTH_LOG)
    vllm = await engines("vllm", ["probe-a"], block_size=64, prefix_caching=False)
    fleet = fleet_of({"name": "v", "url": vllm.url, "kind": "vllm", "block_size": 16})
    poller = HealthPoller(fleet, session)
    for _ in range(3):
        await poller.probe_all()
    e = fleet.engines["r/v"]
    assert e.healthy and (e.block_size, e.block_size_source) == (64, "engine")
    mismatch = "block_size = 16 is configured, but its vllm:cache_config_info says 64"
    assert logged(caplog, logging.WARNING, mismatch) == 1
    assert logged(caplog, logging.WARNING, 'prefix caching is off (enable_prefix_caching="False")') == 1
    assert e.prefix_caching is False and e.describe()["prefix_caching"] is False
    vllm.block_size = 16  # restarted with the configured size: nothing to say, and no second warning
    await poller.probe_all()
    assert e.block_size == 16 and logged(caplog, logging.WARNING, mismatch) == 1


async def test_of_several_models_the_first_that_is_not_an_adapter_is_taken_and_said(
    engines: Callable[..., Awaitable[StockEngine]],
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=HEALTH_LOG)
    vllm = await engines("vllm", ["probe-a"])
    vllm.cards = [card("sql-lora", parent="probe-a"), card("probe-a"), card("probe-b")]
    fleet = fleet_of({"name": "v", "url": vllm.url, "kind": "vllm"})
    await HealthPoller(fleet, session).probe_all()
    e = fleet.engines["r/v"]
    assert e.healthy and e.model == "probe-a"
    assert e.served_models == ("sql-lora", "probe-a", "probe-b")
    assert logged(
        caplog, logging.INFO, "routing it requests for probe-a (the first that is not a LoRA adapter)"
    )


async def test_an_unreadable_metrics_keeps_the_engine_healthy_and_its_load_the_gateways(
    engines: Callable[..., Awaitable[StockEngine]],
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=HEALTH_LOG)
    vllm = await engines("vllm", ["probe-a"], running=9, waiting=3)
    fleet = fleet_of({"name": "v", "url": vllm.url, "kind": "vllm"})
    poller = HealthPoller(fleet, session, unhealthy_after=1)
    e = fleet.engines["r/v"]
    await poller.probe_all()
    assert e.load_reported and e.queue_estimate() == (12, 3)
    vllm.metrics_status = 500
    e.inflight = 2
    for _ in range(3):
        assert await poller.probe(e)
    assert e.healthy and e.last_error is None
    # No stale figure from the last good scrape: only what this gateway has in flight there.
    assert not e.load_reported and e.queue_estimate() == (2, 0)
    assert e.describe()["load"]["source"] == "gateway"
    assert logged(caplog, logging.INFO, "/metrics unreadable: /metrics answered 500") == 1
    assert e.block_size == 16  # what it said before stays
    vllm.metrics_status = 200
    await poller.probe_all()
    assert e.load_reported and e.queue_estimate() == (12, 3)


@pytest.mark.parametrize(
    ("change", "loaded"),
    [
        # A page in Latin-1 with no charset (a proxy's, say): not UTF-8, so not Prometheus text.
        ({"metrics_body": "# maintenance: r\xe9essayez plus tard\n".encode("latin-1")}, False),
        # A block_size label of a digit int() refuses ("²".isdigit() is True): the load still counts.
        ({"block_size": "\u00b2"}, True),
    ],
)
async def test_a_metrics_text_it_cannot_read_is_said_and_never_stops_the_poller(
    engines: Callable[..., Awaitable[StockEngine]],
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    change: dict[str, Any],
    loaded: bool,
) -> None:
    caplog.set_level(logging.INFO, logger=HEALTH_LOG)
    vllm = await engines("vllm", ["probe-a"], running=9, waiting=3)
    idle = await engines("vllm", ["probe-b"])
    fleet = fleet_of(
        {"name": "v", "url": vllm.url, "kind": "vllm"}, {"name": "w", "url": idle.url, "kind": "vllm"}
    )
    poller = HealthPoller(fleet, session, unhealthy_after=1)
    e, other = fleet.engines["r/v"], fleet.engines["r/w"]
    await poller.probe_all()
    assert e.block_size == 16 and e.load_reported
    for name, value in change.items():
        setattr(vllm, name, value)
    idle.running = 5
    await poller.probe_all()  # one engine's odd answer must not stop the others' polls
    assert e.healthy and e.block_size == 16  # what it said before stays
    assert e.load_reported is loaded and e.queue_estimate() == ((12, 3) if loaded else (0, 0))
    assert other.load.running == 5
    assert logged(caplog, logging.INFO, "/metrics unreadable") == (0 if loaded else 1)


async def test_models_are_read_at_first_contact_rarely_after_and_again_after_a_failure(
    engines: Callable[..., Awaitable[StockEngine]],
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=HEALTH_LOG)
    vllm = await engines("vllm", ["probe-a"])
    fleet = fleet_of({"name": "v", "url": vllm.url, "kind": "vllm"})
    poller = HealthPoller(fleet, session, rediscover_every=3)
    for _ in range(7):
        await poller.probe_all()
    assert (vllm.hits["/health"], vllm.hits["/metrics"]) == (7, 7)  # load: every poll
    assert vllm.hits["/v1/models"] == 2  # polls 1 and 5
    e = fleet.engines["r/v"]
    # A restart: one failed check (still healthy: unhealthy_after is 2), then it serves another model.
    vllm.health_status = 503
    assert not await poller.probe(e)
    assert e.healthy
    vllm.health_status, vllm.cards = 200, [card("probe-b")]
    assert await poller.probe(e)
    assert e.model == "probe-b" and fleet.serving("probe-b") == [e] and fleet.serving("probe-a") == []
    assert logged(caplog, logging.WARNING, "now serves probe-b (it served probe-a)") == 1


async def test_sglang_page_size_from_server_info_and_load_from_metrics(
    engines: Callable[..., Awaitable[StockEngine]],
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=HEALTH_LOG)
    info = {"page_size": 32, "disable_radix_cache": False, "max_running_requests": 8}
    new = await engines(
        "sglang", ["qwen"], server_info=info, metrics_status=200, running=2, waiting=5, kv_usage=0.5
    )
    # An older SGLang: /get_server_info only; started without --enable-metrics and with the radix cache off.
    old_info = {"page_size": 16, "disable_radix_cache": True, "max_running_requests": None}
    old = await engines("sglang", ["qwen"], server_info=old_info, server_info_path="/get_server_info")
    fleet = fleet_of(
        {"name": "new", "url": new.url, "kind": "sglang", "block_size": 32},
        {"name": "old", "url": old.url, "kind": "sglang"},
    )
    poller = HealthPoller(fleet, session)
    await poller.probe_all()
    await poller.probe_all()
    a, b = fleet.engines["r/new"], fleet.engines["r/old"]
    assert a.healthy and b.healthy and fleet.serving("qwen") == [a, b]
    assert (a.block_size, a.block_size_source, b.block_size, b.block_size_source) == (
        32,
        "engine",
        16,
        "engine",
    )
    assert (a.load.running, a.load.waiting, a.load.kv_usage, a.load.max_running) == (2, 5, 0.5, 8)
    assert a.queue_estimate() == (7, 5)
    assert not b.load_reported and b.queue_estimate() == (0, 0)
    assert logged(caplog, logging.INFO, "SGLang serves /metrics only with --enable-metrics") == 1
    assert logged(caplog, logging.WARNING, "prefix caching is off (disable_radix_cache=True)") == 1
    assert logged(caplog, logging.WARNING, "block_size") == 0  # configured 32 = its page size
    assert old.hits["/server_info"] == 1 and old.hits["/get_server_info"] == 1  # read at first contact only


async def test_an_openai_server_is_alive_by_its_model_list(
    engines: Callable[..., Awaitable[StockEngine]], session: aiohttp.ClientSession
) -> None:
    server = await engines("openai", ["gpt-x"])
    fleet = fleet_of({"name": "o", "url": server.url, "kind": "openai"})
    poller = HealthPoller(fleet, session, unhealthy_after=2)
    e = fleet.engines["r/o"]
    assert await poller.probe(e)
    assert e.healthy and e.model == "gpt-x" and fleet.serving("gpt-x") == [e]
    d = e.describe()
    assert (d["kind"], d["block_size"], d["block_size_source"], d["load"]["source"]) == (
        "openai",
        None,
        "gateway default",
        "gateway",
    )
    server.models_status = 503
    assert not await poller.probe(e) and e.healthy  # one failure is not yet unhealthy
    assert not await poller.probe(e) and not e.healthy
    assert e.last_error == "/v1/models: /v1/models answered 503"
    assert server.hits["/health"] == 0 and server.hits["/metrics"] == 0


async def test_a_kvgate_engine_is_still_read_from_its_health_alone(
    engines: Callable[..., Awaitable[StockEngine]], session: aiohttp.ClientSession
) -> None:
    async def health(request: web.Request) -> web.Response:
        load = {"running": 2, "waiting": 1, "max_running": 4}
        return web.json_response(
            {"status": "ok", "model": "m", "block_size": 32, "role": "both", "load": load}
        )

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    url = await serve(runner)
    try:
        fleet = fleet_of({"name": "k", "url": url, "block_size": 16})
        await HealthPoller(fleet, session).probe_all()
        e = fleet.engines["r/k"]
        assert e.healthy and e.model == "m" and e.load_reported
        assert (e.block_size, e.block_size_source) == (
            16,
            "config",
        )  # kvgate: the configuration wins, as before
        assert e.queue_estimate() == (3, 1) and e.describe()["kind"] == "kvgate"
    finally:
        await runner.cleanup()


# -- gateway.http.engine_probe.check_tokenizer
# --------------------------------------------------------------------


def vllm_tokenize(
    tokenizer: Tokenizer, *, bos: int | None = None, template: str | None = None, seen: list[Any]
) -> Callable[[dict[str, Any]], Awaitable[web.Response]]:
    """A vLLM ``POST /tokenize`` (vllm/entrypoints/serve/tokenize/protocol.py): a chat rendered with the
    engine's template, a prompt as text; ``add_special_tokens`` (default False for chats, True for prompts)
    puts its BOS token first, as a Llama tokenizer's post-processor does."""

    async def answer(body: dict[str, Any]) -> web.Response:
        seen.append(body)
        if body.get("model") not in (None, "probe-a"):
            error = {
                "message": f"The model `{body['model']}` does not exist.",
                "type": "NotFoundError",
                "code": 404,
            }
            return web.json_response({"error": error}, status=404)
        if "messages" in body:
            text = (
                template.format(**body["messages"][-1])
                if template
                else render_messages(tokenizer, body["messages"])
            )
            special = body.get("add_special_tokens", False)
        else:
            text, special = body["prompt"], body.get("add_special_tokens", True)
        ids = [int(t) for t in tokenizer.encode(text)]
        if special and bos is not None:
            ids.insert(0, bos)
        return web.json_response(
            {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}
        )

    return answer


async def test_check_tokenizer_agrees_and_says_where_it_does_not(
    engines: Callable[..., Awaitable[StockEngine]], session: aiohttp.ClientSession, tiny_model_dir: Path
) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    seen: list[Any] = []
    vllm = await engines("vllm", ["probe-a"])
    fleet = fleet_of({"name": "v", "url": vllm.url, "kind": "vllm"})
    await HealthPoller(fleet, session).probe_all()
    e = fleet.engines["r/v"]

    vllm.tokenize = vllm_tokenize(tokenizer, seen=seen)
    assert await check_tokenizer(e, session, tokenizer) is None
    assert e.tokenizer_agrees is True
    chat, prompt = seen
    assert chat["model"] == "probe-a" and chat["add_generation_prompt"] is True
    assert chat["add_special_tokens"] is False and prompt["add_special_tokens"] is True
    assert [m["role"] for m in chat["messages"]] == ["system", "user"]

    # A tokenizer that puts a BOS before a plain prompt (as /v1/completions tokenizes text): ids sent without
    # it would be a different prompt.
    bos = tokenizer.eos_token_id
    vllm.tokenize = vllm_tokenize(tokenizer, bos=bos, seen=seen)
    said = await check_tokenizer(e, session, tokenizer)
    assert said is not None and "\n" not in said and e.tokenizer_agrees is False
    assert said.startswith("engine r/v (probe-a) tokenizes differently from this gateway: a plain prompt")
    first = int(tokenizer.encode(SAMPLE_PROMPT)[0])
    assert "first differs at token 0" in said and f"engine {bos}" in said and f"gateway {first}" in said
    assert "a chat" not in said  # chats are tokenized without special tokens: they agree

    # A --chat-template override: the chat differs, where it first does.
    vllm.tokenize = vllm_tokenize(tokenizer, template="{role}: {content}\n", seen=seen)
    said = await check_tokenizer(e, session, tokenizer)
    assert said is not None and "a chat (its template and tokenizer) first differs at token 0" in said


async def test_check_tokenizer_cuts_a_huge_refusal(
    engines: Callable[..., Awaitable[StockEngine]], session: aiohttp.ClientSession, tiny_model_dir: Path
) -> None:
    # The line the caller logs as an ERROR carried an engine's whole error message, megabytes of it.
    vllm = await engines("vllm", ["probe-a"])
    fleet = fleet_of({"name": "v", "url": vllm.url, "kind": "vllm"})
    await HealthPoller(fleet, session).probe_all()

    async def refuse(body: dict[str, Any]) -> web.Response:
        error = {"message": "y" * 3_000_000, "type": "BadRequestError", "code": 400}
        return web.json_response({"error": error}, status=400)

    vllm.tokenize = refuse
    said = await check_tokenizer(fleet.engines["r/v"], session, load_tokenizer(tiny_model_dir))
    assert said is not None and "refused to tokenize" in said
    assert len(said) < 4096 and "[cut: 3000000 characters]" in said


async def test_check_tokenizer_without_tokenize_or_with_an_unknown_model(
    engines: Callable[..., Awaitable[StockEngine]], session: aiohttp.ClientSession, tiny_model_dir: Path
) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    vllm = await engines("vllm", ["probe-a"])
    fleet = fleet_of(
        {"name": "v", "url": vllm.url, "kind": "vllm"},
        {"name": "w", "url": vllm.url, "kind": "vllm", "model": "llama"},
    )
    v, w = fleet.engines["r/v"], fleet.engines["r/w"]
    assert await check_tokenizer(v, session, tokenizer) is None  # no /tokenize route: not checked
    assert v.tokenizer_agrees is None and vllm.hits["/tokenize"] == 1
    vllm.tokenize = vllm_tokenize(tokenizer, seen=[])
    said = await check_tokenizer(w, session, tokenizer)  # vLLM's own 404 for a model it does not serve
    assert said is not None and "The model `llama` does not exist." in said and w.tokenizer_agrees is False


async def test_an_unexpected_error_in_one_probe_is_logged_once_and_the_others_keep_being_polled(
    engines: Callable[..., Awaitable[StockEngine]],
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger=HEALTH_LOG)
    broken = await engines("vllm", ["probe-a"])
    fine = await engines("vllm", ["probe-b"])
    fleet = fleet_of(
        {"name": "v", "url": broken.url, "kind": "vllm"}, {"name": "w", "url": fine.url, "kind": "vllm"}
    )
    poller = HealthPoller(fleet, session, interval_s=0.01, unhealthy_after=1)
    e, other = fleet.engines["r/v"], fleet.engines["r/w"]
    real = poller._probe_stock

    async def probe_stock(engine: Any) -> bool:
        if engine is e:  # no real answer triggers it today: stands for a bug in a probe
            raise KeyError("unforeseen")
        return await real(engine)

    monkeypatch.setattr(poller, "_probe_stock", probe_stock)
    poller.start()
    try:
        for running in (3, 7):
            fine.running = running
            # Polls go on (the task is alive) until the healthy engine's new load shows.
            while other.load.running != running:
                assert poller._task is not None and not poller._task.done()
                await asyncio.sleep(0.01)
        assert other.healthy and not e.healthy and "KeyError" in (e.last_error or "")
        assert e.probe_errors >= 2 and other.probe_errors == 0
        errors = [
            r for r in caplog.records if r.levelno == logging.ERROR and "unexpectedly" in r.getMessage()
        ]
        assert len(errors) == 1 and errors[0].exc_info is not None
        metrics = GatewayMetrics()
        metrics.watch(fleet, dict)
        exposed = generate_latest(metrics.registry).decode()
        assert (
            f'kvgate_health_probe_errors_total{{engine="r/v",region="r"}} {float(e.probe_errors)}' in exposed
        )
    finally:
        await poller.stop()
