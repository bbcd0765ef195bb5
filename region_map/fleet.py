"""The live fleet: every engine of the topology with its last known health and load.

Load has two sources: what the engine last reported (kvgate's ``/health``, vLLM's and SGLang's ``/metrics``:
complete but up to one poll interval old) and what this gateway has in flight to it right now (instant but
partial). Routing looks at both; an engine whose load cannot be read is judged by the second alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from cache.foreign_chain import routing_block
from region_map.breaker import CircuitBreaker
from region_map.config import EngineConfig, EngineKind, Role, TopologyConfig
from region_map.discovery import EngineMetrics
from region_map.prefill_queue import PrefillQueue
from region_map.report_lag import ReportLag


class ChainKey(NamedTuple):
    """Which chain of block hashes (contract 1) names an engine's blocks: its block size, and whether it
    shares an operator-declared public prefix across tenants (kvgate engines do; a vLLM or SGLang salts
    every block of a salted request, so its chains are the tenant's from the first block)."""

    block_size: int
    public: bool


class InFlight(Protocol):
    """An exchange in progress with an engine (the gateway's upstream response)."""

    def engine_down(self, reason: str, quiet_s: float) -> None:
        """The engine was declared unhealthy: give up on it unless it answered within ``quiet_s``."""
        ...


@dataclass(slots=True)
class EngineLoad:
    """What an engine reported about itself (kvgate: ``/health``; vLLM, SGLang: ``/metrics``)."""

    running: int = 0
    waiting: int = 0
    waiting_tokens: int = 0
    max_running: int | None = None
    kv_blocks_used: int | None = None
    kv_blocks_free: int | None = None
    kv_usage: float | None = None  # fraction of its KV cache in use, 0-1; None: not reported


@dataclass(slots=True)
class EngineState:
    id: str  # "<region>/<name>": unique across the topology
    region: str
    config: EngineConfig
    healthy: bool = False
    reported_model: str | None = None
    reported_block_size: int | None = None
    reported_role: Role | None = None
    publishes_events: bool | None = None
    reported_kv_pull: bool = False
    reported_token_ids_hex: bool = False
    simulated: bool = False
    # Health probes of this engine that raised an error the probe did not anticipate (region_map.health).
    probe_errors: int = 0
    # Whether its tokenizer and chat template give the gateway's ids (a /tokenize probe once per healthy
    # spell, gateway.http.engine_probe; None: not checked, so a text prompt is sent as text).
    tokenizer_agrees: bool | None = None
    # Blocks this gateway sent it that its KV events have yet to announce, in all: a follower that has heard
    # nothing while this grows is listening in the wrong place.
    awaited_blocks: int = 0
    load: EngineLoad = field(default_factory=EngineLoad)
    load_reported: bool = False  # whether ``load`` is the engine's word (else only this gateway's counts)
    # Discovered on vLLM, SGLang and OpenAI engines (region_map.discovery): every id its /v1/models lists,
    # whether its prefix cache is on, vLLM's hash algorithm, SGLang's max_running_requests.
    served_models: tuple[str, ...] = ()
    prefix_caching: bool | None = None
    hash_algo: str | None = None
    reported_max_running: int | None = None
    last_ok: float | None = None
    consecutive_failures: int = 0
    last_error: str | None = None
    # This gateway's own, instant view of what it has sent there and not yet finished.
    inflight: int = 0
    report_lag: ReportLag = field(default_factory=ReportLag)  # what of ``load`` has ended since
    prefill: PrefillQueue = field(default_factory=PrefillQueue)  # prompts whose first token is not back
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    # The exchanges in flight there, failed at once (unless still answering) when it is declared unhealthy:
    # a frozen engine's requests fail over in seconds instead of waiting out their timeouts.
    exchanges: set[InFlight] = field(default_factory=set)
    down_quiet_s: float = 1.0
    # chain_key's last answer and what it depended on: it is asked for every engine on every request.
    _chain_memo: tuple[tuple[int, int, int | None], ChainKey] | None = field(default=None, repr=False)
    _url_memo: tuple[EngineConfig, str] | None = field(default=None, repr=False, compare=False)

    @property
    def available(self) -> bool:
        """Healthy by its health checks and not skipped by its circuit breaker."""
        return self.healthy and self.breaker.allows()

    @property
    def url(self) -> str:
        """``config.base_url``, made once per configuration (str() of a pydantic URL, for every request)."""
        memo = self._url_memo
        if memo is None or memo[0] is not self.config:
            memo = self._url_memo = (self.config, self.config.base_url)
        return memo[1]

    @property
    def model(self) -> str | None:
        return self.config.model or self.reported_model

    @property
    def block_size(self) -> int | None:
        if self.kind is not EngineKind.KVGATE and self.reported_block_size is not None:
            # vLLM's and SGLang's own value wins over the configuration: prompts hashed in blocks of any
            # other size never match the blocks the engine caches (the poller warns about the mismatch).
            return self.reported_block_size
        return self.config.block_size or self.reported_block_size

    @property
    def block_size_source(self) -> str:
        """Where ``block_size`` comes from: "engine", "config", or "gateway default" (it reports none)."""
        if self.kind is not EngineKind.KVGATE and self.reported_block_size is not None:
            return "engine"
        if self.config.block_size:
            return "config"
        return "engine" if self.reported_block_size else "gateway default"

    @property
    def role(self) -> Role:
        return self.reported_role or self.config.role

    @property
    def kind(self) -> EngineKind:
        return self.config.kind

    @property
    def kv_events(self) -> bool:
        if self.config.kv_events is not None:
            return self.config.kv_events
        if self.kind in (EngineKind.VLLM, EngineKind.SGLANG):
            return self.config.kv_events_endpoint is not None
        return bool(self.publishes_events)

    def token_ids_on(self, path: str) -> bool:
        """Whether a request to ``path`` may carry the prompt as token ids. kvgate engines read
        ``prompt_token_ids`` everywhere; vLLM and SGLang read ids only as ``/v1/completions``' ``prompt``
        (their chat endpoints have no token-id input and would silently ignore one)."""
        accepts = self.config.accepts_token_ids
        if self.kind is EngineKind.KVGATE:
            return accepts is not False
        if self.kind is EngineKind.OPENAI:
            return bool(accepts) and path == "/v1/completions"
        return accepts is not False and path == "/v1/completions"

    @property
    def kv_pull(self) -> bool:
        """Whether it can pull a prefix from a peer and serve its own to one (``/v1/kv/cached``)."""
        if self.config.kv_pull is not None:
            return self.config.kv_pull
        return (
            self.reported_kv_pull
            and self.kind is EngineKind.KVGATE
            and self.config.accepts_token_ids is not False
        )

    @property
    def packed_token_ids(self) -> bool:
        """Whether it takes the prompt's ids packed (``prompt_token_ids_hex``) rather than as JSON numbers."""
        return self.kind is EngineKind.KVGATE and self.token_ids_on("") and self.reported_token_ids_hex

    def chain_key(self, default_block_size: int, min_block_size: int) -> ChainKey:
        """The chain its blocks are named by; ``default_block_size`` for an engine that reports none.

        A vLLM or SGLang engine is routed in blocks of at least ``min_block_size`` tokens (see
        ``routing_block``): SGLang's 1-token pages would otherwise cost a hash and a lookup step per prompt
        token. A kvgate engine keeps its own block size: its events name blocks of exactly that size.
        """
        inputs = (default_block_size, min_block_size, self.reported_block_size)
        memo = self._chain_memo
        if memo is not None and memo[0] == inputs:
            return memo[1]
        kvgate = self.kind is EngineKind.KVGATE
        block_size = self.block_size or default_block_size
        key = ChainKey(block_size if kvgate else routing_block(block_size, min_block_size), kvgate)
        self._chain_memo = (inputs, key)
        return key

    def queue_estimate(self) -> tuple[int, int]:
        """(requests in the engine, requests waiting for a slot), merging reported and local load. The
        reported load is taken without the requests of this gateway that it counts and that have ended."""
        total = max(self.load.running + self.load.waiting - self.report_lag.stale, self.inflight)
        # Whether the requests that ended since were waiting or running, the reading does not say; but no
        # more can wait than are left in the engine (a queue of this gateway's that has ended is no queue).
        waiting = min(self.load.waiting, total)
        if self.load.max_running:
            waiting = max(waiting, self.inflight - self.load.max_running)
        return total, waiting

    def waits_for_room(self, queued_tokens: int) -> bool:
        """Whether requests queued here may be waiting for a slot or for KV memory that running requests
        hold: waits that ``queued_tokens`` (the prompt tokens queued for prefill) cannot price, so the load
        guard counts them instead. An engine shows it does not only by reporting its slot limit, its free
        KV blocks and its queued tokens: a slot free and room for all of ``queued_tokens``; its queue then
        waits for prefill budget, which the tokens price. vLLM's metrics give no slot limit and SGLang's no
        KV capacity: their queues are always counted."""
        load = self.load
        # Its free blocks are counted in its own block size, which a configured one need not be.
        block_size = self.reported_block_size or self.block_size
        max_running, free_blocks = load.max_running, load.kv_blocks_free
        # (An engine that has not reported its load, or whose metrics could not be read, has no free blocks.)
        if max_running is None or free_blocks is None or block_size is None:
            return True
        if load.running >= max_running or self.inflight > max_running:
            return True
        if load.waiting_tokens < load.waiting:
            # Every waiting request has at least its last prompt token to compute: a report with fewer
            # queued tokens does not price its queue (an engine that does not say them, or says them wrong).
            return True
        return queued_tokens > free_blocks * block_size

    def queued_prefill_tokens(self, now: float, s_per_token: float) -> int:
        """Prompt tokens still to prefill here at ``now`` (monotonic): this gateway's own count of what it
        sent, drained at ``s_per_token``, or what the engine reported, whichever is larger."""
        reported = self.load.waiting_tokens - self.report_lag.stale_tokens  # (less what has ended since)
        return max(self.prefill.estimate(now, s_per_token), reported)

    def apply_health(self, payload: dict[str, Any]) -> bool:
        """Take in an engine's ``/health`` JSON (kvgate's shape; other servers' bodies are tolerated).
        Returns whether the model it serves or its role changed (the fleet's model table must then be
        rebuilt: routing keeps what it derives from a model's engine list while the list is the same)."""
        model_before, role_before = self.model, self.role
        self.mark_alive()
        if isinstance(payload.get("model"), str):
            self.reported_model = payload["model"]
        if isinstance(payload.get("block_size"), int) and payload["block_size"] > 0:
            self.reported_block_size = payload["block_size"]
        if payload.get("role") in Role.__members__.values():
            self.reported_role = Role(payload["role"])
        if isinstance(payload.get("kv_events"), bool):
            self.publishes_events = payload["kv_events"]
        self.simulated = payload.get("simulated") is True
        self.reported_kv_pull = payload.get("kv_pull") is True
        self.reported_token_ids_hex = payload.get("token_ids_hex") is True
        load = payload.get("load")
        if isinstance(load, dict):
            self.load = EngineLoad(
                running=_int(load.get("running")) or 0,
                waiting=_int(load.get("waiting")) or 0,
                waiting_tokens=_int(load.get("waiting_tokens")) or 0,
                max_running=_int(load.get("max_running")),
                kv_blocks_used=_int(load.get("kv_blocks_used")),
                kv_blocks_free=_int(load.get("kv_blocks_free")),
            )
            self.load_reported = True
            self.report_lag.answered()
        return self.model != model_before or self.role is not role_before

    def mark_alive(self) -> None:
        """It answered its health check (and, where that is checked, serves what it should)."""
        self.healthy = True
        self.consecutive_failures = 0
        self.last_error = None
        self.last_ok = time.monotonic()

    def apply_models(self, served: tuple[str, ...], model: str) -> bool:
        """Take in the ids ``/v1/models`` listed and the model routed to it (``discovery.choose_model``).
        Returns whether the model it serves changed (the fleet's model table must then be rebuilt)."""
        model_before = self.model
        self.served_models = served
        self.reported_model = model
        return self.model != model_before

    def apply_metrics(self, metrics: EngineMetrics | None) -> None:
        """Take in a ``/metrics`` scrape; None (or one without load) when it could not be read: the load is
        then what this gateway has in flight there, never a stale figure from an earlier scrape."""
        if metrics is None or (metrics.running is None and metrics.waiting is None):
            self.load = EngineLoad(max_running=self.reported_max_running)
            self.load_reported = False
            self.report_lag.answered()
            return
        used = free = None
        if metrics.kv_capacity_blocks is not None and metrics.kv_usage is not None:
            # vLLM's num_gpu_blocks is per data-parallel rank, and the usage their mean.
            total = metrics.kv_capacity_blocks * self.config.data_parallel_size
            used = round(metrics.kv_usage * total)
            free = total - used
        self.load = EngineLoad(
            running=metrics.running or 0,
            waiting=metrics.waiting or 0,
            max_running=self.reported_max_running,
            kv_blocks_used=used,
            kv_blocks_free=free,
            kv_usage=metrics.kv_usage,
        )
        self.load_reported = True
        self.report_lag.answered()

    def mark_failure(self, error: str, *, unhealthy_after: int) -> None:
        self.consecutive_failures += 1
        self.last_error = error
        if self.consecutive_failures >= unhealthy_after:
            self.healthy = False
            # Every failed check of an unhealthy engine looks again: an exchange that was still answering at
            # the last one may have fallen silent since.
            for exchange in list(self.exchanges):
                exchange.engine_down(error, self.down_quiet_s)

    def describe(self) -> dict[str, Any]:
        total, waiting = self.queue_estimate()
        return {
            "id": self.id,
            "region": self.region,
            "url": self.url,
            "kind": self.kind.value,
            "role": self.role.value,
            "model": self.model,
            "served_models": list(self.served_models),
            "block_size": self.block_size,
            "block_size_source": self.block_size_source,
            "prefix_caching": self.prefix_caching,
            "tokenizer_agrees": self.tokenizer_agrees,
            "healthy": self.healthy,
            "breaker": self.breaker.state.value,
            "kv_events": self.kv_events,
            "kv_pull": self.kv_pull,
            "simulated": self.simulated,
            "load": {
                "requests": total,
                "waiting": waiting,
                "inflight_here": self.inflight,
                "kv_usage": self.load.kv_usage,
                "source": "engine" if self.load_reported else "gateway",
            },
            "last_error": self.last_error,
        }


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class Fleet:
    """Engines of every region, by id, with the RTT from this gateway's region."""

    def __init__(self, topology: TopologyConfig) -> None:
        self.topology = topology
        self.region = topology.region
        self.engines: dict[str, EngineState] = {}
        for region in topology.regions:
            for engine in region.engines:
                engine_id = f"{region.name}/{engine.name}"
                self.engines[engine_id] = EngineState(id=engine_id, region=region.name, config=engine)
        self._rtt = {r.name: topology.rtt_s(self.region, r.name) for r in topology.regions}
        self._by_model: dict[str, list[EngineState]] = {}
        self.refresh_models()

    def __iter__(self) -> Iterator[EngineState]:
        return iter(self.engines.values())

    def __len__(self) -> int:
        return len(self.engines)

    def get(self, engine_id: str) -> EngineState | None:
        return self.engines.get(engine_id)

    def rtt_s(self, region: str, home: str | None = None) -> float:
        """Round trip from ``home`` (default: this gateway's region) to ``region``."""
        if home is None or home == self.region:
            return self._rtt.get(region, self.topology.default_rtt_ms / 1000.0)
        return self.topology.rtt_s(home, region)

    def refresh_models(self) -> None:
        """Rebuild the model -> engines table (after an engine reported a different model)."""
        by_model: dict[str, list[EngineState]] = {}
        for e in self:
            if e.model:
                by_model.setdefault(e.model, []).append(e)
        self._by_model = by_model

    def chain_keys(self, model: str, default_block_size: int, min_block_size: int) -> list[ChainKey]:
        """The distinct chains of the engines serving ``model``: a prompt is hashed once per chain."""
        keys = {e.chain_key(default_block_size, min_block_size) for e in self._by_model.get(model, ())}
        return sorted(keys) or [ChainKey(default_block_size, True)]

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def serving(self, model: str) -> list[EngineState]:
        """Engines configured for or reporting ``model`` (healthy or not); empty for an unknown model."""
        return self._by_model.get(model, [])
