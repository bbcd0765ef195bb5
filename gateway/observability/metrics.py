"""Prometheus metrics of the gateway, in a registry of its own (one per app, so tests can run several).

The cache hit ratio is ``kvgate_cached_prompt_tokens_total / kvgate_prompt_tokens_total``, both from the
engines' own usage reports, per region and engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.observability.loop_metrics import LoopCounter, LoopHistogram
from region_map.breaker import BreakerState
from region_map.fleet import EngineState, Fleet

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
_OVERHEAD_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        # (region, prompt tokens, cached tokens, ttft, itl) of every finished request: the dashboard's feed
        self.listeners: list[Callable[[str, int, int, float | None, float | None], None]] = []
        r = self.registry
        self.requests = LoopCounter(
            "kvgate_requests",
            "Requests answered, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.routing = LoopCounter(
            "kvgate_routing_decisions",
            "Routing outcomes: session, prefix, miss, moved, least_load, round_robin, failover.",
            ["region", "engine", "reason"],
            registry=r,
        )
        self.prompt_tokens = LoopCounter(
            "kvgate_prompt_tokens", "Prompt tokens, as reported by engines.", ["region", "engine"], registry=r
        )
        self.cached_tokens = LoopCounter(
            "kvgate_cached_prompt_tokens",
            "Prompt tokens served from an engine's prefix cache (usage.prompt_tokens_details.cached_tokens).",
            ["region", "engine"],
            registry=r,
        )
        self.predicted_cached_tokens = LoopCounter(
            "kvgate_predicted_cached_prompt_tokens",
            "Prompt tokens the router expected to be cached where it sent them.",
            ["region", "engine"],
            registry=r,
        )
        self.completion_tokens = LoopCounter(
            "kvgate_completion_tokens",
            "Completion tokens, as reported by engines.",
            ["region", "engine"],
            registry=r,
        )
        self.ttft = LoopHistogram(
            "kvgate_time_to_first_token_seconds",
            "From request arrival to the first streamed byte of the answer.",
            ["region", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = LoopHistogram(
            "kvgate_inter_token_latency_seconds",
            "Mean time between the tokens of a stream, one observation per stream.",
            ["region", "model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.latency = LoopHistogram(
            "kvgate_request_duration_seconds",
            "From request arrival to the end of the response.",
            ["region", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = LoopHistogram(
            "kvgate_routing_overhead_seconds",
            "Time from request arrival until it leaves for the engine (parse, tokenize, hash, route).",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.admission_refused = LoopCounter(
            "kvgate_admission_refused",
            "Requests refused at once (503) because every engine for the model was at its queue limit.",
            ["model"],
            registry=r,
        )
        self.usage_records = LoopCounter(
            "kvgate_usage_records",
            "Usage records handed to the ledger, by outcome (completed, aborted, failed) and whether the "
            "token counts are the gateway's estimate (the engine's usage never came).",
            ["outcome", "estimated"],
            registry=r,
        )
        self.kv_pulls = LoopCounter(
            "kvgate_kv_pulls",
            "Requests sent to an engine told to pull their cached prefix from a peer of its region.",
            ["region"],
            registry=r,
        )
        self.kv_pull_tokens = LoopCounter(
            "kvgate_kv_pull_tokens",
            "Prompt tokens engines were told to pull from a peer (what the residency view expected).",
            ["region"],
            registry=r,
        )
        self.pd_requests = LoopCounter(
            "kvgate_disaggregated_requests",
            "Requests to disaggregated engines, by prefill path (remote: K/V transferred; local: decode "
            "engine prefilled itself) and engines.",
            ["region", "path", "prefill_engine", "decode_engine"],
            registry=r,
        )
        self.cross_region = LoopCounter(
            "kvgate_cross_region_requests",
            "Requests served outside the client's home region, by home and serving region.",
            ["home_region", "region"],
            registry=r,
        )
        self.upstream_errors = LoopCounter(
            "kvgate_upstream_errors",
            "Failed exchanges with engines, by kind.",
            ["engine", "kind"],
            registry=r,
        )
        # The public port's edge (gateway.http.edge): connections refused at accept, requests too slow to
        # arrive.
        self.connections_refused = LoopCounter(
            "kvgate_connections_refused",
            "Client connections refused at accept (503, closed) by the cap they met: total or per_client.",
            ["reason"],
            registry=r,
        )
        self.read_timeouts = LoopCounter(
            "kvgate_request_read_timeouts",
            "Requests whose head (header) or body (body) did not arrive in time: 408 if it could still be "
            "written, and the connection closed.",
            ["phase"],
            registry=r,
        )
        self.write_timeouts = LoopCounter(
            "kvgate_client_write_timeouts",
            "Client connections closed because the client read nothing of its answers for idle_timeout_s.",
            (),
            registry=r,
        )
        self.write_timeouts.labels()  # (shown from the start, at 0)
        self.open_connections: Callable[[], int] = lambda: (
            0
        )  # the server's count (gateway.http.server sets it)
        # Followers of vLLM/SGLang KV events (gateway.state.zmq_events) and of kvgate's own engines'
        # (gateway.state.kv_events), read at scrape time.
        self.event_followers: list[EventFollower] = []
        self.own_event_followers: list[OwnEventFollower] = []
        r.register(_EventFollowerCollector(self.event_followers, self.own_event_followers))
        r.register(
            _CallbackGauge(
                "kvgate_client_connections",
                "Client connections open on the public port.",
                lambda: float(self.open_connections()),
            )
        )

    def refused_admission(self, model: str) -> None:
        self.admission_refused.labels(model).inc()

    def routed(self, region: str, engine: str, reason: str, predicted_cached: int, home: str) -> None:
        self.routing.labels(region, engine, reason).inc()
        self.predicted_cached_tokens.labels(region, engine).inc(predicted_cached)
        if home != region:
            self.cross_region.labels(home, region).inc()

    def finished(
        self,
        region: str,
        engine: str,
        model: str,
        *,
        latency_s: float,
        ttft_s: float | None,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        itl_s: float | None = None,
    ) -> None:
        self.latency.labels(region, model).observe(latency_s)
        if ttft_s is not None:
            self.ttft.labels(region, model).observe(ttft_s)
        if itl_s is not None:
            self.itl.labels(region, model).observe(itl_s)
        for listener in self.listeners:
            listener(region, prompt_tokens, cached_tokens, ttft_s, itl_s)
        if prompt_tokens:
            self.prompt_tokens.labels(region, engine).inc(prompt_tokens)
        if cached_tokens:
            self.cached_tokens.labels(region, engine).inc(cached_tokens)
        if completion_tokens:
            self.completion_tokens.labels(region, engine).inc(completion_tokens)

    def usage_recorded(self, outcome: str, estimated: bool) -> None:
        self.usage_records.labels(outcome, "true" if estimated else "false").inc()

    def kv_pulled(self, region: str, tokens: int) -> None:
        self.kv_pulls.labels(region).inc()
        self.kv_pull_tokens.labels(region).inc(tokens)

    def disaggregated(self, region: str, path: str, prefill_engine: str, decode_engine: str) -> None:
        self.pd_requests.labels(region, path, prefill_engine, decode_engine).inc()

    def upstream_error(self, engine: str, kind: str) -> None:
        self.upstream_errors.labels(engine, kind).inc()

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def watch(
        self,
        fleet: Fleet,
        gauges: Callable[[], dict[str, tuple[str, float]]],
        counters: Callable[[], dict[str, tuple[str, float]]] = dict,
    ) -> None:
        """Engine health and in-flight requests, and the given process gauges and counters (counts that
        only grow: exposed as ``kvgate_<name>_total``), read at scrape time."""
        self.registry.register(_LiveCollector(fleet, gauges, counters))


class EventFollower(Protocol):
    """What the metrics read of a follower of an engine's KV events (gateway.state.zmq_events)."""

    engine: EngineState
    batches: int
    resyncs: int
    replays: int
    gaps: int
    restarts: int
    decode_errors: int
    unknown_events: int
    disconnects: int
    oversized_messages: int
    errors: int

    @property
    def unknown_parent_blocks(self) -> int: ...

    @property
    def unindexable_blocks(self) -> int: ...

    @property
    def ignored_blocks(self) -> int: ...


class OwnEventFollower(Protocol):
    """What the metrics read of a follower of a kvgate engine's KV events (gateway.state.kv_events)."""

    engine: EngineState
    batches: int
    resyncs: int
    unknown_events: int
    oversized_messages: int


class _EventFollowerCollector(Collector):
    """Counters of the KV event followers: how well the residency index follows vLLM and SGLang engines."""

    FIELDS = (
        ("batches", "kvgate_kv_event_batches", "Engine KV event batches applied to the residency index."),
        ("resyncs", "kvgate_kv_event_resyncs", "Times an engine's index entries were replaced wholesale."),
        ("replays", "kvgate_kv_event_replays", "Replays asked of the engine (on connect, a gap, silence)."),
        ("gaps", "kvgate_kv_event_gaps", "Sequence gaps seen on an engine's live event stream."),
        ("restarts", "kvgate_kv_event_restarts", "Engine restarts seen in its events (seq back to 0)."),
        ("decode_errors", "kvgate_kv_event_decode_errors", "Event batches that could not be read."),
        ("unknown_events", "kvgate_kv_event_unknown_events",
         "Events of a type unknown here (a newer engine), skipped; the rest of their batch applies."),
        ("unknown_parent_blocks", "kvgate_kv_event_unknown_parent_blocks",
         "Stored blocks not indexed because their parent was never seen (a missed batch)."),
        ("unindexable_blocks", "kvgate_kv_event_unindexable_blocks",
         "Stored blocks that cannot be indexed (multimodal, an odd block size, ...)."),
        ("ignored_blocks", "kvgate_kv_event_ignored_blocks",
         "Blocks of another medium (CPU, disk offload) or KV cache group, not routed on."),
        ("disconnects", "kvgate_kv_event_disconnects", "Event publisher connections that dropped."),
        ("oversized_messages", "kvgate_kv_event_oversized_messages",
         "Event messages over gateway.kv_event_max_message_bytes, refused (their connection dropped; lost)."),
        ("errors", "kvgate_kv_event_errors",
         "Unexpected failures while following an engine's events (logged with a traceback: a bug)."),
    )  # fmt: skip

    # Counters that both kinds of follower keep: labelled with their source, "zmq" (vLLM, SGLang) or
    # "kvgate" (kvgate's own engines, over HTTP), since the two followers skip events for different reasons.
    BY_SOURCE = frozenset({"batches", "resyncs", "unknown_events"})
    # Counters that both keep under the one meaning, unlabelled by source (an engine is followed by one).
    SHARED = frozenset({"oversized_messages"})

    def __init__(self, followers: list[EventFollower], own: list[OwnEventFollower]) -> None:
        self._followers = followers
        self._own = own

    def collect(self) -> Iterable[Metric]:
        for attr, name, documentation in self.FIELDS:
            if attr not in self.BY_SOURCE:
                family = CounterMetricFamily(name, documentation, labels=["region", "engine"])
                for f in self._followers:
                    family.add_metric([f.engine.region, f.engine.id], float(getattr(f, attr)))
                if attr in self.SHARED:
                    for o in self._own:
                        family.add_metric([o.engine.region, o.engine.id], float(getattr(o, attr)))
                yield family
                continue
            family = CounterMetricFamily(name, documentation, labels=["region", "engine", "source"])
            for f in self._followers:
                family.add_metric([f.engine.region, f.engine.id, "zmq"], float(getattr(f, attr)))
            for o in self._own:
                family.add_metric([o.engine.region, o.engine.id, "kvgate"], float(getattr(o, attr)))
            yield family

    def describe(self) -> Iterable[Metric]:
        return []


class _CallbackGauge(Collector):
    """One gauge read at scrape time."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name = name
        self._documentation = documentation
        self._read = read

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(self._name, self._documentation, value=self._read())

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(self._name, self._documentation)]


class _LiveCollector(Collector):
    def __init__(
        self,
        fleet: Fleet,
        gauges: Callable[[], dict[str, tuple[str, float]]],
        counters: Callable[[], dict[str, tuple[str, float]]],
    ) -> None:
        self._fleet = fleet
        self._gauges = gauges
        self._counters = counters

    def collect(self) -> Iterable[Metric]:
        healthy = GaugeMetricFamily(
            "kvgate_engine_healthy", "1 if the engine answers its health checks.", labels=["region", "engine"]
        )
        inflight = GaugeMetricFamily(
            "kvgate_engine_inflight_requests",
            "Requests this gateway has in flight to the engine.",
            labels=["region", "engine"],
        )
        breaker = GaugeMetricFamily(
            "kvgate_engine_breaker_open",
            "1 while the engine's circuit breaker skips it (open or half-open).",
            labels=["region", "engine"],
        )
        load = GaugeMetricFamily(
            "kvgate_engine_reported_requests",
            "Running + waiting requests the engine last reported.",
            labels=["region", "engine"],
        )
        probe_errors = CounterMetricFamily(
            "kvgate_health_probe_errors",
            "Health probes of the engine that failed with an error the probe did not anticipate (a bug).",
            labels=["region", "engine"],
        )
        for e in self._fleet:
            probe_errors.add_metric([e.region, e.id], float(e.probe_errors))
            healthy.add_metric([e.region, e.id], 1.0 if e.healthy else 0.0)
            breaker.add_metric([e.region, e.id], 0.0 if e.breaker.state is BreakerState.CLOSED else 1.0)
            inflight.add_metric([e.region, e.id], float(e.inflight))
            load.add_metric([e.region, e.id], float(e.load.running + e.load.waiting))
        yield healthy
        yield breaker
        yield inflight
        yield load
        yield probe_errors
        for name, (help_text, value) in self._gauges().items():
            yield GaugeMetricFamily(f"kvgate_{name}", help_text, value=value)
        for name, (help_text, value) in self._counters().items():
            yield CounterMetricFamily(f"kvgate_{name}", help_text, value=value)  # (adds the _total)

    def describe(self) -> Iterable[Metric]:
        return []
