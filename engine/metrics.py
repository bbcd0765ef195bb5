"""Prometheus metrics of an engine (the real one and the simulator expose the same names on ``/metrics``).

Busy time is a counter per stage, ``kvgate_engine_busy_seconds_total{stage="prefill"|"decode"}``: its rate
is the busy ratio (``rate(...[1m])`` = the share of wall time spent in that stage). Everything else is read
from the engine at scrape time, so serving a request costs no metric updates beyond the busy clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache.scrape_format import choose_format

STAGES = ("prefill", "decode")
PULL_OUTCOMES = ("ok", "partial", "failed")  # every position asked for / fewer (the peer evicted some) / none


class BusyClock:
    """Seconds during which at least one piece of work of a stage was in progress. Overlapping work (the
    simulator's concurrent requests) counts once: the clock measures the stage's wall-time occupancy."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # the real engine's loop runs on a thread of its own
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = self._clock()
            self._active += 1

    def exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._total += self._clock() - self._since

    def add(self, seconds: float) -> None:
        """Time measured elsewhere (a model step, split between the stages by its tokens)."""
        with self._lock:
            self._total += seconds

    @property
    def seconds(self) -> float:
        with self._lock:
            running = self._clock() - self._since if self._active else 0.0
            return self._total + running


@dataclass
class EngineCounters:
    """What an engine counts as it serves; read at scrape time."""

    busy: dict[str, BusyClock] = field(default_factory=lambda: {s: BusyClock() for s in STAGES})
    requests: int = 0  # finished
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    embedding_requests: int = 0  # /v1/embeddings requests answered (apart: they generate nothing)
    embedding_prompt_tokens: int = 0  # ... and their inputs' tokens
    # KV pulls: this engine fetching a cached prefix from a peer, and serving one to a peer
    kv_pulls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PULL_OUTCOMES, 0))
    kv_pulled_tokens: int = 0
    kv_pull_served: int = 0
    kv_pull_served_tokens: int = 0

    def finished(self, prompt_tokens: int, cached_tokens: int, generated_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_prompt_tokens += cached_tokens
        self.generated_tokens += generated_tokens

    def embedded(self, prompt_tokens: int) -> None:
        self.embedding_requests += 1
        self.embedding_prompt_tokens += prompt_tokens

    def pulled(self, outcome: str, tokens: int) -> None:
        self.kv_pulls[outcome] += 1
        self.kv_pulled_tokens += tokens

    def pull_served(self, tokens: int) -> None:
        self.kv_pull_served += 1
        self.kv_pull_served_tokens += tokens


@dataclass(frozen=True)
class EngineGauges:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    gpu_utilization: float | None = None  # 0..1 on a GPU that reports it


class _Collector(Collector):
    def __init__(self, engine_id: str, counters: EngineCounters, gauges: Callable[[], EngineGauges]) -> None:
        self._engine_id = engine_id
        self._counters = counters
        self._gauges = gauges

    def collect(self) -> Iterable[Metric]:
        c, g, engine = self._counters, self._gauges(), [self._engine_id]
        busy = CounterMetricFamily(
            "kvgate_engine_busy_seconds",
            "Wall time with work of the stage in progress; its rate is the stage's busy ratio.",
            labels=["engine", "stage"],
        )
        for stage, clock in c.busy.items():
            busy.add_metric([*engine, stage], clock.seconds)
        yield busy
        queue = GaugeMetricFamily(
            "kvgate_engine_requests", "Requests in the engine, by state.", labels=["engine", "state"]
        )
        queue.add_metric([*engine, "running"], g.running)
        queue.add_metric([*engine, "waiting"], g.waiting)
        yield queue
        blocks = GaugeMetricFamily(
            "kvgate_engine_kv_blocks", "KV cache blocks, by state.", labels=["engine", "state"]
        )
        blocks.add_metric([*engine, "used"], g.kv_blocks_used)
        blocks.add_metric([*engine, "free"], g.kv_blocks_free)
        yield blocks
        for name, doc, value in (
            ("kvgate_engine_requests_finished", "Requests finished.", c.requests),
            ("kvgate_engine_prompt_tokens", "Prompt tokens of finished requests.", c.prompt_tokens),
            ("kvgate_engine_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
             c.cached_prompt_tokens),
            ("kvgate_engine_generation_tokens", "Tokens generated.", c.generated_tokens),
            ("kvgate_engine_embedding_requests", "Embedding requests answered.", c.embedding_requests),
            ("kvgate_engine_embedding_prompt_tokens", "Input tokens of answered embedding requests.",
             c.embedding_prompt_tokens),
            ("kvgate_engine_kv_pulled_tokens", "Prompt positions whose K/V was pulled from a peer's cache.",
             c.kv_pulled_tokens),
            ("kvgate_engine_kv_pull_served", "KV pulls served to peers from the prefix cache.",
             c.kv_pull_served),
            ("kvgate_engine_kv_pull_served_tokens", "Positions whose K/V was sent to pulling peers.",
             c.kv_pull_served_tokens),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=["engine"])
            counter.add_metric(engine, value)
            yield counter
        pulls = CounterMetricFamily(
            "kvgate_engine_kv_pulls",
            "KV pulls from a peer's prefix cache, by outcome (a failed one is computed here instead).",
            labels=["engine", "outcome"],
        )
        for outcome, count in c.kv_pulls.items():
            pulls.add_metric([*engine, outcome], count)
        yield pulls
        if g.gpu_utilization is not None:
            gpu = GaugeMetricFamily(
                "kvgate_engine_gpu_utilization_ratio", "GPU utilisation (0..1).", labels=["engine"]
            )
            gpu.add_metric(engine, g.gpu_utilization)
            yield gpu


def metrics_handler(
    engine_id: str, counters: EngineCounters, gauges: Callable[[], EngineGauges]
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A ``GET /metrics`` handler over a registry of its own (several engines may share a process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(engine_id, counters, gauges))

    async def handler(request: web.Request) -> web.Response:
        # OpenMetrics to a scraper that asks for it, else the classic text format (as the gateway does).
        encode, content_type = choose_format(request.headers.get("Accept", ""))
        response = web.Response(body=encode(registry))
        response.headers["Content-Type"] = content_type
        return response

    return handler


def gpu_utilization(device: object) -> float | None:
    """The device's utilisation when torch can read it (CUDA with NVML); None elsewhere."""
    try:
        import torch

        if str(device).startswith("cuda") and torch.cuda.is_available():
            return float(torch.cuda.utilization(device)) / 100.0  # type: ignore[arg-type]
    except Exception:
        return None
    return None
