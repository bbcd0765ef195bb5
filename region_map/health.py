"""Polls every engine in the background and keeps the fleet's health, load and discovered facts current.

What a poll asks depends on the engine's kind (``EngineConfig.kind``):

- **kvgate**: ``/health``, whose JSON carries model, block size, role and load.
- **vllm**, **sglang**: ``/health`` (200: alive) and ``/metrics`` (load) every interval; at first contact,
  whenever the engine comes back after being unhealthy (a restarted engine may serve another model) and
  every ``rediscover_every`` polls, also ``/v1/models`` (the model) and, on SGLang, ``/server_info`` (its
  page size). vLLM's block size comes with every ``/metrics`` (``vllm:cache_config_info``).
- **openai**: no ``/health`` is promised: ``/v1/models`` answering 200 is the health check and names the
  model.

Contradictions are never silent: a configured model the engine does not list makes it unhealthy (every
request would 404) and is logged at ERROR; a configured block size other than the engine's own, or an engine
without prefix caching, is logged at WARNING. Each such message is logged once, until it changes or clears.
A ``/metrics`` that cannot be read never makes an engine unhealthy: its load is then only this gateway's own
requests in flight there.

``https://`` engines are checked over TLS with the session's connector, which the gateway builds with the
same context as its requests (``gateway.http.upstream_tls.engine_tls_context``): an engine the requests would
refuse is never reported healthy.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from cache.cancelling import cancel_and_wait
from region_map.config import EngineKind
from region_map.discovery import (
    DiscoveryError,
    ServedModel,
    choose_model,
    parse_metrics,
    parse_models,
    parse_server_info,
)
from region_map.fleet import EngineState, Fleet

log = logging.getLogger("kvgate.health")

# Everything one request of a poll may fail with; none of it escapes a probe.
_PROBE_ERRORS = (aiohttp.ClientError, TimeoutError, OSError, RuntimeError, DiscoveryError)


class _Status(RuntimeError):
    """An endpoint answered with a status other than 200."""

    def __init__(self, path: str, status: int) -> None:
        super().__init__(f"{path} answered {status}")
        self.status = status


class HealthPoller:
    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        unhealthy_after: int = 2,
        rediscover_every: int = 30,
    ) -> None:
        self.fleet = fleet
        self._session = session
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.unhealthy_after = unhealthy_after
        self.rediscover_every = rediscover_every
        self._task: asyncio.Task[None] | None = None
        # Healthy polls of each vLLM/SGLang engine since its /v1/models was last read (absent: never read).
        self._since_discovery: dict[str, int] = {}
        # What was last logged per (engine id, topic): a standing condition is logged once, not every poll.
        self._said: dict[tuple[str, str], str] = {}
        self._probed: set[str] = set()  # engines checked at least once (an engine failing its first check
        # is unhealthy since the gateway started: no transition says so)

    async def probe(self, engine: EngineState) -> bool:
        """One health check of one engine; returns whether it answered healthy."""
        try:
            if engine.kind is EngineKind.KVGATE:
                return await self._probe_kvgate(engine)
            if engine.kind is EngineKind.OPENAI:
                return await self._probe_openai(engine)
            return await self._probe_stock(engine)
        finally:
            self._probed.add(engine.id)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._guarded_probe(e) for e in self.fleet))

    async def _guarded_probe(self, engine: EngineState) -> None:
        """``probe``, with any error it did not anticipate (a bug, or an answer no parser foresaw) taken as a
        failed check of this engine: raised out of the gather, it stopped the polling task, and with it the
        health and load of every engine."""
        engine.report_lag.asking()
        try:
            await self.probe(engine)
        except Exception as exc:  # the whole point: nothing escapes one engine's probe
            engine.probe_errors += 1  # kvgate_health_probe_errors_total
            message = f"{type(exc).__name__}: {exc}"
            key = (engine.id, "probe_error")
            if self._said.get(key) != message:  # once per engine and distinct error, not every poll
                self._said[key] = message
                log.error("engine %s: health probe failed unexpectedly: %s", engine.id, message, exc_info=exc)
            self._failed(engine, f"health probe error: {message}")
        else:
            self._clear(engine, "probe_error")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.probe_all()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvgate-health")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    # -- per kind ------------------------------------------------------------------------------------------

    async def _probe_kvgate(self, engine: EngineState) -> bool:
        try:
            payload = await self._get_json(engine, "/health", empty_ok=True)
        except _PROBE_ERRORS as exc:
            return self._failed(engine, _describe(exc))
        was_healthy = engine.healthy
        health = payload if isinstance(payload, dict) else {}
        if engine.apply_health(health):
            self.fleet.refresh_models()
        if engine.model is None and "model" not in health:
            # An empty or foreign /health: this is no kvgate engine (a deployment file of URLs alone, in front
            # of vLLM, say). Learn its model from /v1/models so that requests reach it, and say what to set.
            return await self._not_kvgate(engine, was_healthy)
        if not was_healthy:
            log.info("engine %s is healthy", engine.id)
        return True

    async def _not_kvgate(self, engine: EngineState, was_healthy: bool) -> bool:
        """Its model from /v1/models; ``was_healthy``: before this poll's /health counted it alive."""
        self._say(
            engine,
            "kind",
            logging.WARNING,
            'answers /health without kvgate\'s fields: not a kvgate engine? Set its kind ("vllm", '
            '"sglang" or "openai") so that the gateway reads its events, metrics and block size; until '
            "then its model comes from /v1/models and its residency from this gateway's own routing records",
        )
        try:
            served = parse_models(await self._get_json(engine, "/v1/models"))
        except _PROBE_ERRORS as exc:
            # At once, not after ``unhealthy_after`` polls: its /health answering counted it alive a moment
            # ago, so each poll would fail it once and it would stay "healthy" (in /health, in the metrics)
            # with no model to be routed to: a web page answering at the engine's URL, say.
            error = f"no model in /health, and /v1/models: {_describe(exc)}"
            return self._failed(engine, error, unhealthy_after=1, was_healthy=was_healthy)
        return self._take_models(engine, served)

    async def _probe_openai(self, engine: EngineState) -> bool:
        # An OpenAI server promises no /health; its model list answering is the sign of life, read every poll.
        try:
            served = parse_models(await self._get_json(engine, "/v1/models"))
        except _PROBE_ERRORS as exc:
            return self._failed(engine, f"/v1/models: {_describe(exc)}")
        if not self._take_models(engine, served):
            return False
        self._alive(engine)
        return True

    async def _probe_stock(self, engine: EngineState) -> bool:
        """vLLM and SGLang: alive by ``/health``, what they serve by ``/v1/models``, load by ``/metrics``."""
        try:
            await self._get_json(engine, "/health", empty_ok=True)  # both answer an empty 200
        except _PROBE_ERRORS as exc:
            return self._failed(engine, _describe(exc))
        polls = self._since_discovery.get(engine.id)
        if polls is None or not engine.healthy or polls >= self.rediscover_every:
            if not await self._discover(engine):
                return False
        else:
            self._since_discovery[engine.id] = polls + 1
        await self._read_metrics(engine)
        self._alive(engine)
        return True

    # -- discovery -----------------------------------------------------------------------------------------

    async def _discover(self, engine: EngineState) -> bool:
        """Read what a vLLM or SGLang engine serves; False when it must not count as healthy."""
        try:
            served = parse_models(await self._get_json(engine, "/v1/models"))
        except _PROBE_ERRORS as exc:
            if engine.healthy:
                # A healthy engine keeps what it said last time, and is asked again at the next poll.
                log.debug("engine %s: /v1/models failed (%s); asking again next poll", engine.id, exc)
                return True
            # Nothing routes to an engine whose model is unverified (it could 404 every request).
            return self._failed(engine, f"/v1/models: {_describe(exc)}")
        if not self._take_models(engine, served):
            return False
        self._since_discovery[engine.id] = 0
        if engine.kind is EngineKind.SGLANG:
            await self._read_server_info(engine)
        return True

    def _take_models(self, engine: EngineState, served: list[ServedModel]) -> bool:
        choice = choose_model(served, engine.config.model)
        if choice.model is None:
            error = choice.error or "/v1/models lists no model"
            # At once, not after ``unhealthy_after`` polls: every request routed there would come back 404.
            engine.mark_failure(error, unhealthy_after=1)
            self._say(engine, "model", logging.ERROR, f"{error}: not routing to it")
            return False
        self._clear(engine, "model")
        if choice.note is not None:
            self._say(engine, "models", logging.INFO, choice.note)
        else:
            self._clear(engine, "models")
        before = engine.model
        if engine.apply_models(tuple(m.id for m in served), choice.model):
            self.fleet.refresh_models()
            if before is not None:
                log.warning("engine %s now serves %s (it served %s)", engine.id, engine.model, before)
        return True

    async def _read_server_info(self, engine: EngineState) -> None:
        """SGLang's page size (its block size), radix cache and running-request limit."""
        payload: Any = None
        error: BaseException | None = None
        # /server_info since late 2025; /get_server_info before (and deprecated, with a warning, after).
        for path in ("/server_info", "/get_server_info"):
            try:
                payload = await self._get_json(engine, path)
                break
            except _PROBE_ERRORS as exc:
                error = exc
                if not (isinstance(exc, _Status) and exc.status == 404):
                    break
        try:
            info = parse_server_info(payload) if payload is not None else None
        except DiscoveryError as exc:
            info, error = None, exc
        if info is None:
            why = _describe(error) if error is not None else "no answer"
            self._say(engine, "server_info", logging.INFO, f"no page size from /server_info ({why})")
            return
        self._clear(engine, "server_info")
        engine.reported_max_running = info.max_running
        engine.load.max_running = info.max_running
        if info.page_size is not None:
            self._take_block_size(engine, info.page_size, "/server_info page_size")
        self._take_prefix_caching(engine, info.prefix_caching, "disable_radix_cache=True")

    async def _read_metrics(self, engine: EngineState) -> None:
        try:
            text = await self._get_text(engine, "/metrics")
            metrics = parse_metrics(engine.kind, text)
        except _PROBE_ERRORS as exc:
            hint = ""
            if engine.kind is EngineKind.SGLANG and isinstance(exc, _Status) and exc.status == 404:
                hint = " (SGLang serves /metrics only with --enable-metrics)"
            self._say(
                engine,
                "metrics",
                logging.INFO,
                f"/metrics unreadable: {_describe(exc)}{hint}; its load is this gateway's own requests there",
            )
            engine.apply_metrics(None)
            return
        if metrics.running is None and metrics.waiting is None:
            self._say(
                engine,
                "metrics",
                logging.INFO,
                f"/metrics carries no {engine.kind.value} request gauges; its load is this gateway's own "
                "requests there",
            )
        elif self._clear(engine, "metrics"):
            log.info("engine %s: /metrics readable again", engine.id)
        engine.apply_metrics(metrics)
        if engine.kind is EngineKind.VLLM:
            if metrics.block_size is not None:
                self._take_block_size(engine, metrics.block_size, "vllm:cache_config_info")
            self._take_prefix_caching(engine, metrics.prefix_caching, 'enable_prefix_caching="False"')
            engine.hash_algo = metrics.hash_algo or engine.hash_algo

    def _take_block_size(self, engine: EngineState, size: int, where: str) -> None:
        configured = engine.config.block_size
        if configured is not None and configured != size:
            # The engine's value wins: the gateway must hash prompts in the blocks the engine caches.
            self._say(
                engine,
                "block_size",
                logging.WARNING,
                f"block_size = {configured} is configured, but its {where} says {size}: hashing its prompts "
                f"in {size}-token blocks",
            )
        else:
            self._clear(engine, "block_size")
        if engine.reported_block_size not in (None, size):
            log.warning("engine %s: block size %s is now %d", engine.id, engine.reported_block_size, size)
        engine.reported_block_size = size

    def _take_prefix_caching(self, engine: EngineState, enabled: bool | None, flag: str) -> None:
        if enabled is False:
            self._say(
                engine,
                "prefix_caching",
                logging.WARNING,
                f"prefix caching is off ({flag}): it recomputes every prompt, and routing by cached prefix "
                "cannot help there",
            )
        else:
            self._clear(engine, "prefix_caching")
        if enabled is not None:
            engine.prefix_caching = enabled

    # -- outcomes and logging ------------------------------------------------------------------------------

    def _alive(self, engine: EngineState) -> None:
        was_healthy = engine.healthy
        engine.mark_alive()
        if not was_healthy:
            log.info(
                "engine %s is healthy: %s serving %s, block size %s (%s), load from %s",
                engine.id,
                engine.kind.value,
                engine.model,
                engine.block_size or "the gateway's",
                engine.block_size_source,
                "its /metrics" if engine.load_reported else "this gateway's requests",
            )

    def _failed(
        self,
        engine: EngineState,
        error: str,
        *,
        unhealthy_after: int | None = None,
        was_healthy: bool | None = None,
    ) -> bool:
        """Count a failed check (``unhealthy_after``: this gateway's, unless given) and say what changed;
        ``was_healthy``: its state before this poll, where the poll already counted it alive once."""
        # Whatever failed, the next answer may come from a restarted engine: read what it serves again then.
        self._since_discovery.pop(engine.id, None)
        was_healthy = engine.healthy if was_healthy is None else was_healthy
        engine.mark_failure(error, unhealthy_after=unhealthy_after or self.unhealthy_after)
        if was_healthy and not engine.healthy:
            log.warning("engine %s is unhealthy: %s", engine.id, engine.last_error)
        elif engine.id not in self._probed:
            log.warning(
                "engine %s is unhealthy since the gateway started: %s; no request goes there until it "
                "answers",
                engine.id,
                error,
            )
        return False

    def _say(self, engine: EngineState, topic: str, level: int, message: str) -> None:
        """Log ``message`` unless it is what was last said about ``topic`` for this engine."""
        key = (engine.id, topic)
        if self._said.get(key) != message:
            self._said[key] = message
            log.log(level, "engine %s: %s", engine.id, message)

    def _clear(self, engine: EngineState, topic: str) -> bool:
        """The condition behind ``topic`` is gone; returns whether one had been logged."""
        return self._said.pop((engine.id, topic), None) is not None

    # -- HTTP ----------------------------------------------------------------------------------------------

    async def _get_json(self, engine: EngineState, path: str, *, empty_ok: bool = False) -> Any:
        """The JSON of a 200 answer to GET ``path``; raises _Status for any other status. ``empty_ok``: a
        body that is not JSON (a stock server's empty 200) reads as {}."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self._session.get(f"{engine.url}{path}", timeout=timeout) as resp:
            if resp.status != 200:
                raise _Status(path, resp.status)
            try:
                return await resp.json(content_type=None)
            except ValueError:
                if empty_ok:
                    return {}
                raise DiscoveryError(f"{path} answered something other than JSON") from None

    async def _get_text(self, engine: EngineState, path: str) -> str:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self._session.get(f"{engine.url}{path}", timeout=timeout) as resp:
            if resp.status != 200:
                raise _Status(path, resp.status)
            try:
                return await resp.text()
            except UnicodeDecodeError:
                # Not an engine's exposition text (that is UTF-8): a proxy's page, say. Raised as it was, it
                # escaped every probe and stopped the health poller for the whole fleet.
                raise DiscoveryError(f"{path} answered text that is not UTF-8") from None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        # aiohttp's own text buries the reason in a repr of the ssl error; say it as the request path does.
        reason = getattr(exc.certificate_error, "verify_message", None) or exc.certificate_error
        return f"TLS handshake with {exc.host}:{exc.port} failed: certificate refused: {reason}"
    return str(exc) or type(exc).__name__
