"""``/dashboard``: live charts served by the gateway itself, assets shipped in the package (no CDN).

A sampler closes a window every ``interval_s``: per region the cache hit ratio of the prompts that finished
in it (engine-reported cached / prompt tokens), time to first token p50/p90, inter-token latency p50,
requests per second, each engine's load, and the active sessions. The page polls ``/dashboard/data`` and
draws the last ``keep`` windows. Observing a request is two appends; the percentiles are computed once per
window, off the request path.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from cache.cancelling import cancel_and_wait
from gateway.http.errors import NotFound
from gateway.http.lean_request import LeanRequest
from gateway.http.lean_routes import LeanHandler
from region_map.fleet import Fleet
from region_map.simulation.simulator import percentile

ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
ASSETS_DIR = Path(__file__).with_name("dashboard_assets")  # shipped as package data
# The page runs its own script and style only (no inline code, nothing from elsewhere) and polls its data
# from the same origin: a policy that strict leaves an injected script nothing to run, and no other site may
# frame the page to click through it. Every answer says its type is what it says (no sniffing).
NO_SNIFF = {"X-Content-Type-Options": "nosniff"}
PAGE_HEADERS = {
    **NO_SNIFF,
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


@dataclass
class _Window:
    requests: int = 0
    prompt: dict[str, int] = field(default_factory=dict)  # per region
    cached: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


class DashboardSampler:
    def __init__(
        self,
        fleet: Fleet,
        sessions: Callable[[], int],
        *,
        interval_s: float = 2.0,
        keep: int = 300,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fleet = fleet
        self._sessions = sessions
        self.interval_s = interval_s
        self._clock = clock
        self._window = _Window()
        self._opened = clock()
        self.samples: deque[dict[str, Any]] = deque(maxlen=keep)
        self._task: asyncio.Task[None] | None = None

    def observe(
        self, region: str, prompt_tokens: int, cached_tokens: int, ttft_s: float | None, itl_s: float | None
    ) -> None:
        w = self._window
        w.requests += 1
        w.prompt[region] = w.prompt.get(region, 0) + prompt_tokens
        w.cached[region] = w.cached.get(region, 0) + cached_tokens
        if ttft_s is not None:
            w.ttft.append(ttft_s)
        if itl_s is not None:
            w.itl.append(itl_s)

    def sample_now(self) -> dict[str, Any]:
        """Close the current window into a sample."""
        now = self._clock()
        w, self._window = self._window, _Window()
        span = max(now - self._opened, 1e-9)
        self._opened = now
        sample = {
            "t": now,
            "requests_per_s": w.requests / span,
            "hit_ratio": {r: (w.cached[r] / p if p else None) for r, p in w.prompt.items()},
            "ttft_p50_s": _quantile(w.ttft, 0.5),
            "ttft_p90_s": _quantile(w.ttft, 0.9),
            "itl_p50_s": _quantile(w.itl, 0.5),
            "engine_load": {e.id: e.queue_estimate()[0] for e in self.fleet},
            "sessions": self._sessions(),
        }
        self.samples.append(sample)
        return sample

    def data(self) -> dict[str, Any]:
        return {
            "interval_s": self.interval_s,
            "regions": sorted({e.region for e in self.fleet}),
            "engines": [{"id": e.id, "region": e.region, "healthy": e.healthy} for e in self.fleet],
            "samples": list(self.samples),
        }

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.sample_now()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvgate-dashboard")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None


def _quantile(values: list[float], q: float) -> float | None:
    """None for a window without observations: a quiet window shows a gap, not a zero."""
    return percentile(values, q) if values else None


def _asset(name: str) -> bytes:
    return (ASSETS_DIR / name).read_bytes()


def dashboard_routes(sampler: DashboardSampler) -> list[tuple[str, LeanHandler]]:
    """The dashboard's page, its data and its assets, as GET routes."""
    page = _asset("index.html")
    assets = {name: (_asset(name), content_type) for name, content_type in ASSETS.items()}

    async def index(request: LeanRequest) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS)

    async def data(request: LeanRequest) -> web.Response:
        return web.Response(
            body=orjson.dumps(sampler.data()),
            content_type="application/json",
            headers={**NO_SNIFF, "Cache-Control": "no-store"},
        )

    async def asset(request: LeanRequest) -> web.Response:
        found = assets.get(request.match_info["name"])
        if found is None:
            raise NotFound(f"no dashboard asset {request.match_info['name'][:80]!r}", code="not_found")
        body, content_type = found
        return web.Response(
            body=body, content_type=content_type, headers={**NO_SNIFF, "Cache-Control": "max-age=300"}
        )

    return [("/dashboard", index), ("/dashboard/data", data), ("/dashboard/assets/{name}", asset)]
