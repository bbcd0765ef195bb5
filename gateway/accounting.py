"""Accounting for one answered request: the cost the client sees in its usage, then metrics, the access
log line and exactly one ledger record when the answer ends (a stream the client left is billed for what it
had received)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from cache.ledger import UsageRecord
from gateway.billing import Billing, usage_counts
from gateway.metrics import GatewayMetrics
from gateway.prepare import Prepared
from gateway.relay import Outcome
from region_map.fleet import EngineState

access_log = logging.getLogger("kvgate.access")


class RequestAccount:
    """Accounts for one relayed answer: its cost in the usage the client sees, then metrics and exactly one
    ledger record once it ends (a stream the client left counts what it had received)."""

    __slots__ = ("access_log", "billing", "engine", "metrics", "p", "predicted", "received", "settle")

    def __init__(
        self,
        p: Prepared,
        engine: EngineState,
        *,
        billing: Billing,
        metrics: GatewayMetrics,
        access_log: bool,
        received: float,
        predicted: int,
        settle: Callable[[], None],
    ) -> None:
        self.p = p
        self.engine = engine
        self.billing = billing
        self.metrics = metrics
        self.access_log = access_log
        self.received = received
        self.predicted = predicted  # cached prompt tokens the router expected: an aborted stream's estimate
        self.settle = settle  # the pending prefill this request put on the engine's load

    def annotate(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self.billing.usage_extras(self.p.model, usage)

    def done(
        self, usage: dict[str, Any] | None, first_byte: float | None, outcome: Outcome, events: int
    ) -> None:
        self.settle()
        p, engine = self.p, self.engine
        prompt, cached, completion = usage_counts(usage)
        now = time.perf_counter()
        itl = (now - first_byte) / (completion - 1) if first_byte is not None and completion > 1 else None
        self.metrics.finished(
            engine.region,
            engine.id,
            p.model,
            latency_s=now - self.received,
            ttft_s=None if first_byte is None else first_byte - self.received,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            itl_s=itl,
        )
        estimated = usage is None
        if estimated:
            if first_byte is None:
                self._log(outcome, now, first_byte, prompt, cached, completion, 0)
                return  # nothing reached the client: nothing to bill
            # The stream ended before the engine's usage: bill what the client received, by the gateway's
            # own counts (the prompt it sent, the cache it predicted, one token per streamed event).
            prompt, cached, completion = len(p.token_ids), self.predicted, events
        cost = self.billing.cost_picodollars(p.model, prompt, cached, completion)
        self._log(outcome, now, first_byte, prompt, cached, completion, cost)
        self.billing.record(
            UsageRecord(
                record_id=p.record_id,
                tenant=p.tenant,
                model=p.model,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
                cost_picodollars=cost,
                status=outcome,
                key_id=p.key_id,
                region=engine.region,
                engine=engine.id,
                request_id=p.request_id,
                estimated=estimated,
            )
        )
        self.metrics.usage_recorded(outcome, estimated)

    def _log(
        self,
        outcome: Outcome,
        now: float,
        first_byte: float | None,
        prompt: int,
        cached: int,
        completion: int,
        cost: int,
    ) -> None:
        if not self.access_log or not access_log.isEnabledFor(logging.INFO):
            return
        p = self.p
        fields = {
            "request_id": p.request_id,
            "tenant": p.tenant,
            "model": p.model,
            "region": self.engine.region,
            "engine": self.engine.id,
            "home_region": p.home_region,
            "outcome": outcome,
            "stream": p.stream,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": completion,
            "ttft_s": None if first_byte is None else round(first_byte - self.received, 6),
            "latency_s": round(now - self.received, 6),
            "cost_usd": cost / 10**12,
        }
        access_log.info("request finished", extra={"fields": fields})
