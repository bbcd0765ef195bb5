"""The gateway's application: its routes (served by ``gateway.http.lean_http``), the OpenAI-shaped errors
every handler's failures become, and every long-lived resource in one lifespan (an aiohttp application,
whose runner and cleanup context hold them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.registry import Collector

from cache.cancelling import cancel_and_wait
from cache.journal import UsageJournal
from cache.ledger import MemoryLedger
from cache.ledger_redis import RedisLedger
from cache.redis_client import AnyRedis
from cache.redis_keys import RedisKeys
from cache.scrape_format import choose_format
from cache.spool import Spool
from cache.tokens import Tokenizer, TokenizerError, load_tokenizer
from gateway.config import KvgateConfig
from gateway.http.engine_probe import check_tokenizers_forever
from gateway.http.errors import GatewayError
from gateway.http.http_wire import Answer
from gateway.http.lean_request import LeanRequest
from gateway.http.lean_routes import LeanHandler, Route, Routes
from gateway.http.upstream import UpstreamClients
from gateway.http.upstream_tls import engine_tls_context
from gateway.observability.dashboard import DashboardSampler, dashboard_routes
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.operator import OperatorSite, guarded, public_health, start_operator_site
from gateway.observability.worker_metrics import WorkerMetrics
from gateway.redis_connection import check_redis, redis_client, redis_db
from gateway.request_limits import EMBEDDINGS_PATH, RESPONSES_PATH
from gateway.routing import POLICIES
from gateway.service import Gateway
from gateway.state.kv_events import KvEventConsumer
from gateway.state.shared_state import SharedState
from gateway.state.zmq_events import ZmqKvEventConsumer
from gateway.tenancy.billing import Billing, spool_path
from gateway.tenancy.ledger_writer import LedgerWriter
from gateway.tenancy.ratelimit import MemoryBuckets, RateLimiter, RedisBuckets
from gateway.tenancy.tenants import FileKeyStore, KeyStore, MemoryKeyStore, RedisKeyStore
from gateway.tenancy.usage_api import UsageApi
from region_map.config import ConfigError, EngineKind
from region_map.fleet import Fleet
from region_map.health import HealthPoller

log = logging.getLogger("kvgate.app")

GATEWAY = web.AppKey("gateway", Gateway)
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
STORED_RESPONSE_PATH = RESPONSES_PATH + "/{response:path}"  # (an id, then /cancel or /input_items)
MODEL_PATH = "/v1/models/{model:path}"  # (model ids may hold slashes: meta-llama/Llama-3.1-8B)
DASHBOARD = web.AppKey("dashboard", DashboardSampler)
ROUTES = web.AppKey("routes", Routes)  # the public port's
OPERATOR_ROUTES = web.AppKey("operator_routes", Routes)  # served on gateway.operator_port, when set
WORKER_METRICS = web.AppKey("worker_metrics", WorkerMetrics)  # kvgate serve --workers N, no operator port


async def _answer(
    handler: LeanHandler, request: LeanRequest, endpoint: str, metrics: GatewayMetrics
) -> Answer:
    """The handler's response, or the OpenAI-shaped error for whatever it raised; counted per endpoint."""
    try:
        response = await handler(request)
    except GatewayError as exc:
        response = exc.response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        response = GatewayError("internal error in the gateway; it has been logged").response()
    metrics.answered(endpoint, response.status)
    return response


def _counted(endpoint: str, handler: LeanHandler, metrics: GatewayMetrics) -> LeanHandler:
    async def answer(request: LeanRequest) -> Answer:
        return await _answer(handler, request, endpoint, metrics)

    return answer


def _routes(metrics: GatewayMetrics, table: list[tuple[str, LeanHandler]]) -> list[Route]:
    """GET routes (HEAD too), each handler's errors answered and counted as every endpoint's are."""
    return [Route(path, {"GET": _counted(path, handler, metrics)}) for path, handler in table]


def public_routes(app: web.Application) -> Routes:
    """What the public port serves (``gateway.http.server`` serves it with ``gateway.http.lean_http``)."""
    return app[ROUTES]


def build_app(config: KvgateConfig) -> web.Application:
    """The gateway as an aiohttp app; resources open when the app starts and close when it stops."""
    settings = config.gateway
    if settings.routing.policy not in POLICIES:
        raise ConfigError(
            f"gateway.routing.policy: unknown policy {settings.routing.policy!r} "
            f"(one of {', '.join(POLICIES)})"
        )
    redis = (
        redis_client(settings.redis_url, settings.redis_max_connections, cluster=settings.redis_cluster)
        if settings.redis_url
        else None
    )
    fleet = Fleet(config.topology)
    metrics = GatewayMetrics()
    billing = build_billing(config, redis)
    state = SharedState(
        gateway_id=config.gateway_id,
        redis=redis,
        keys=RedisKeys(settings.redis_prefix, db=redis_db(redis)),
        session_ttl_s=settings.session_ttl_s,
        response_ttl_s=settings.response_ttl_s,
        max_approximate_per_engine=settings.redis_max_approximate_per_engine,
        redis_sweep_every_s=settings.redis_sweep_interval_s,
    )
    gateway = Gateway(
        config,
        fleet=fleet,
        state=state,
        clients=UpstreamClients(
            connect_timeout=settings.connect_timeout_s,
            # Built now, so that an unusable CA or client certificate file stops the start.
            ssl_context=engine_tls_context(
                ca_file=settings.engine_tls_ca_file,
                cert_file=settings.engine_tls_cert_file,
                key_file=settings.engine_tls_key_file,
            ),
        ),
        metrics=metrics,
        tokenizer=gateway_tokenizer(config),
        policy=POLICIES[settings.routing.policy](settings.routing),
        billing=billing,
    )
    usage = UsageApi(billing)
    sessions = state.sessions.live_count  # (sweeps what expired first: costs what expired since, not a scan)
    dashboard = DashboardSampler(fleet, sessions, interval_s=settings.dashboard_interval_s)
    metrics.listeners.append(dashboard.observe)
    metrics.watch(
        fleet,
        lambda: {
            "sessions": ("Live session bindings in this gateway's view.", float(sessions())),
            "residency_entries": ("(block, engine) entries in this gateway's view.", float(len(state.index))),
            "redis_backlog": ("Writes waiting to reach Redis.", float(len(state.writer))),
            "ledger_backlog": ("Usage records waiting to be written.", float(billing.writer.pending)),
            "ledger_degraded": ("1 while usage records go to the spool.", float(billing.writer.degraded)),
            "ledger_spool_failing": (
                "1 while the spool refuses usage records too: they wait in memory (ledger_backlog).",
                float(billing.writer.spool_failing),
            ),
            "usage_journal_failing": (
                "1 while the disk refuses the usage journal's entries: a crash would lose in-flight records.",
                float(billing.journal is not None and (billing.journal.failing or billing.journal.removed)),
            ),
        },
        # Counts since the start that never go down: counters, so that rate() and increase() apply.
        lambda: {
            "redis_write_failures": ("Writes to Redis that failed.", float(state.writer.failed)),
            "ledger_spooled_records": (
                "Usage records written to the local spool while the ledger was away.",
                float(billing.writer.spooled),
            ),
            "usage_journal_write_failures": (
                "Usage journal entries the disk refused (the requests were served and billed).",
                float(billing.journal.write_failures if billing.journal is not None else 0),
            ),
        },
    )
    if not settings.lean_http:
        log.warning(
            "gateway.lean_http = false is no longer an option: gateway.http.lean_http serves every request"
        )
    _warn_of_shared_caches(fleet, settings.auth.enabled)
    app = web.Application()
    app[GATEWAY] = gateway
    app[DASHBOARD] = dashboard
    app.cleanup_ctx.append(_lifespan)
    completions = [
        (CHAT_PATH, gateway.chat_completions),
        (COMPLETIONS_PATH, gateway.completions),
        (RESPONSES_PATH, gateway.responses),
        (EMBEDDINGS_PATH, gateway.embeddings),
    ]
    public = [
        ("/v1/models", guarded(billing, "/v1/models", gateway.models)),
        (MODEL_PATH, guarded(billing, MODEL_PATH, gateway.model)),
        ("/v1/usage", usage.tenant_usage),
        ("/v1/admin/usage", usage.admin_usage),
        ("/health", public_health(gateway)),
    ]
    scraped: Collector = metrics.registry
    if config.worker_metrics_dir is not None and settings.operator_port is None:
        # One public port for N workers: any of them answers for all (an operator port is each one's own).
        scraped = app[WORKER_METRICS] = WorkerMetrics(config.worker_metrics_dir, config.gateway_id, scraped)
    operator = [("/metrics", _metrics_handler(scraped)), *dashboard_routes(dashboard)]
    if settings.operator_port is None:
        public += [(path, guarded(billing, path, handler)) for path, handler in operator]
    else:  # (the Prometheus convention: the operator's endpoints on a port of their own, without keys)
        app[OPERATOR_ROUTES] = Routes(_routes(metrics, [("/health", gateway.health), *operator]))
    # The completion endpoints' keys are checked once their headers are in, before their bodies are read.
    hot = [
        Route(path, {"POST": _counted(path, handler, metrics)}, key_first=True)
        for path, handler in completions
    ]
    stored = _counted(STORED_RESPONSE_PATH, gateway.stored_response, metrics)
    hot.append(Route(STORED_RESPONSE_PATH, {"GET": stored, "POST": stored, "DELETE": stored}, key_first=True))
    app[ROUTES] = Routes([*hot, *_routes(metrics, public)])
    return app


def gateway_tokenizer(config: KvgateConfig) -> Tokenizer:
    """The tokenizer of gateway.tokenizer; one it cannot load is the operator's mistake, said as such (it was
    an "unexpected error ... please report it")."""
    try:
        return load_tokenizer(config.gateway.tokenizer)
    except TokenizerError as exc:
        raise ConfigError(f"gateway.tokenizer: {exc}") from None


def build_billing(config: KvgateConfig, redis: AnyRedis | None) -> Billing:
    """Keys, ledger and rate-limit buckets: in Redis when the gateway has it, else in process."""
    settings = config.gateway
    prefix = settings.redis_prefix
    keys: KeyStore
    if settings.auth.keys_file:
        keys = FileKeyStore(settings.auth.keys_file)
    elif redis is not None:
        keys = RedisKeyStore(redis, prefix)
    else:
        keys = MemoryKeyStore()
    if redis is not None:
        path = spool_path(config)
        try:
            spool = Spool(path)
        except OSError as exc:
            raise ConfigError(f"gateway.spool_path: cannot keep the ledger spool there: {exc}") from None
        writer = LedgerWriter(RedisLedger(redis, prefix), spool, journal=UsageJournal(path))
        limiter = RateLimiter(RedisBuckets(redis, prefix))
    else:
        writer = LedgerWriter(MemoryLedger())
        limiter = RateLimiter(MemoryBuckets())
    return Billing(config, keys=keys, ledger=writer.ledger, writer=writer, limiter=limiter)


def _warn_of_shared_caches(fleet: Fleet, tenants: bool) -> None:
    """Tenants' prefix caches are kept apart by ``cache_salt``, which only kvgate and vLLM engines take.
    Behind an SGLang or other OpenAI engine, a tenant that sends another's prompt finds its KV there:
    ``cached_tokens`` (and its TTFT) tell it someone sent that prompt. Said at start, with tenants."""
    shared = [e.id for e in fleet if e.kind not in (EngineKind.KVGATE, EngineKind.VLLM)]
    if tenants and shared:
        log.warning(
            "engines %s take no cache_salt: tenants share their prefix caches there, and one can learn from "
            "cached_tokens and time to first token whether another sent the same prompt",
            ", ".join(shared),
        )


def _metrics_handler(scraped: Collector) -> LeanHandler:
    async def handler(request: LeanRequest) -> web.Response:
        # As prometheus_client's own servers: OpenMetrics to a scraper that asks for it (Prometheus does),
        # else the classic text format under the name of the version that the body is written in; a
        # version no format has is passed over (scrape_format), not a 500 nor echoed in Content-Type.
        encode, content_type = choose_format(request.headers.get("Accept", ""))
        response = web.Response(body=encode(scraped))
        response.headers["Content-Type"] = content_type
        return response

    return handler


def _for_life(work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A task meant to run as long as the gateway does. One that ends on an error is said at once, with
    its traceback: from then on what it did (following an engine's KV events, checking tokenizers) is not
    done until a restart, and an operator learns it from the log rather than from stale routing."""
    task = asyncio.create_task(work, name=name)
    task.add_done_callback(_say_if_it_failed)
    return task


def _say_if_it_failed(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error(
            "%s stopped on an error: %s: %s (it runs again at the next start)",
            task.get_name(), type(error).__name__, error, exc_info=error,
        )  # fmt: skip


async def _lifespan(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    settings = gateway.settings
    fleet, state = gateway.fleet, gateway.state
    # Health checks and KV events verify https:// engines with the same TLS context as requests do.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=gateway.clients.ssl_context))
    poller = HealthPoller(
        fleet,
        session,
        interval_s=settings.health_interval_s,
        timeout_s=settings.health_timeout_s,
        unhealthy_after=settings.unhealthy_after,
    )
    consumers: list[asyncio.Task[None]] = []
    billing = gateway.billing
    operator: OperatorSite | None = None
    try:
        if OPERATOR_ROUTES in app:
            operator = await start_operator_site(
                app[OPERATOR_ROUTES],
                settings.operator_host,
                settings.operator_port or 0,
                settings=settings,
                answered=gateway.metrics.answered,
            )
            gateway.operator_url = operator.url
        # Replays first what an earlier run left: its spool, and the requests its journal still owed.
        redis_said = "off"
        if state.redis is not None:
            redis_said = await check_redis(state, settings.redis_url or "")
        await billing.writer.start(billing.cost_picodollars)
        app[DASHBOARD].start()
        if WORKER_METRICS in app:
            app[WORKER_METRICS].start()
        await state.start([e.id for e in fleet])
        await poller.probe_all()
        poller.start()
        for engine in fleet:
            if engine.kind is EngineKind.KVGATE and engine.config.kv_events is not False:
                consumer = KvEventConsumer(
                    engine, session, state, max_message_bytes=settings.kv_event_max_message_bytes
                )
                gateway.metrics.own_event_followers.append(consumer)
                consumers.append(_for_life(consumer.run(), f"kv-events-{engine.id}"))
            elif engine.kv_events and engine.config.kv_events_endpoint is not None:
                # vLLM and SGLang publish over ZMQ (their events carry the token ids kvgate hashes).
                follower = ZmqKvEventConsumer(
                    engine,
                    state,
                    min_block_size=settings.min_block_size,
                    max_message_bytes=settings.kv_event_max_message_bytes,
                )
                gateway.metrics.event_followers.append(follower)
                consumers.append(_for_life(follower.run(), f"zmq-kv-events-{engine.id}"))
        consumers.append(
            _for_life(
                check_tokenizers_forever(
                    fleet, session, gateway.prepare.tokenizer, settings.health_interval_s
                ),
                "kvgate-tokenizer-checks",
            )
        )
        log.info(
            "gateway %s in region %s: %d of %d engines healthy, redis %s",
            state.gateway_id,
            fleet.region,
            sum(e.healthy for e in fleet),
            len(fleet),
            redis_said,
        )
        yield
    finally:
        # A follower's error was said when it ended (_say_if_it_failed); raised here, it would skip the
        # rest of the stop: the ledger's flush among it.
        with contextlib.suppress(Exception):
            await cancel_and_wait(*consumers)
        await poller.stop()
        if operator is not None:
            await operator.close(gateway.resilience.drain_timeout_s)
        await app[DASHBOARD].stop()
        await billing.writer.stop()  # every record is in the ledger or the spool
        if WORKER_METRICS in app:
            await app[WORKER_METRICS].stop()  # (after the last request's counts)
        await state.stop()
        gateway.clients.close()
        await session.close()
        if state.redis is not None:
            await state.redis.aclose()
