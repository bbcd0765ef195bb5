"""Polls every engine's ``/health`` in the background and keeps the fleet's health and load current.

``https://`` engines are checked over TLS with the session's connector, which the gateway builds with the
same context as its requests (``gateway.upstream.engine_tls_context``): an engine the requests would
refuse is never reported healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from region_map.fleet import EngineState, Fleet

log = logging.getLogger("kvgate.health")


class HealthPoller:
    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        unhealthy_after: int = 2,
    ) -> None:
        self.fleet = fleet
        self._session = session
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.unhealthy_after = unhealthy_after
        self._task: asyncio.Task[None] | None = None

    async def probe(self, engine: EngineState) -> bool:
        """One health check of one engine; returns whether it answered healthy."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with self._session.get(f"{engine.url}/health", timeout=timeout) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"/health answered {resp.status}")
                try:
                    payload = await resp.json(content_type=None)
                except ValueError:
                    payload = {}  # a stock server's empty 200 still means healthy
        except (aiohttp.ClientError, TimeoutError, RuntimeError, OSError) as exc:
            was_healthy = engine.healthy
            engine.mark_failure(_describe(exc), unhealthy_after=self.unhealthy_after)
            if was_healthy and not engine.healthy:
                log.warning("engine %s is unhealthy: %s", engine.id, engine.last_error)
            return False
        was_healthy = engine.healthy
        if engine.apply_health(payload if isinstance(payload, dict) else {}):
            self.fleet.refresh_models()
        if not was_healthy:
            log.info("engine %s is healthy", engine.id)
        return True

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in self.fleet))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.probe_all()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvgate-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        # aiohttp's own text buries the reason in a repr of the ssl error; say it as the request path does.
        reason = getattr(exc.certificate_error, "verify_message", None) or exc.certificate_error
        return f"TLS handshake with {exc.host}:{exc.port} failed: certificate refused: {reason}"
    return str(exc) or type(exc).__name__
