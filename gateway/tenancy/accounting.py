"""Accounting for one request sent to an engine: the cost the client sees in its usage, then metrics, the
access log line and exactly one ledger record when the answer ends (a stream the client left is billed for
what it had received; a request the client left before any byte, for the prompt the engine took).

With a usage journal (``cache.journal``), the request is in it from the moment it is dispatched, and its
final record before the last byte of the answer leaves: a gateway that dies still bills what the engine did.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from cache.journal import Dispatched
from cache.ledger import UsageRecord
from gateway.http.relay import Outcome
from gateway.observability.metrics import GatewayMetrics
from gateway.prepared import Prepared
from gateway.tenancy.billing import Billing, credible_counts
from region_map.fleet import EngineState

access_log = logging.getLogger("kvgate.access")
log = logging.getLogger("kvgate.ledger")


PROGRESS_EVERY_S = 1.0  # how often a running stream notes its completion tokens in the journal


class RequestAccount:
    """Accounts for one request an engine takes: its cost in the usage the client sees, then metrics and
    exactly one ledger record once it ends (``done``), or none when nothing was billable (``void``)."""

    __slots__ = (
        "_final",
        "_progress_at",
        "access_log",
        "billing",
        "closed",
        "engine",
        "metrics",
        "p",
        "predicted",
        "received",
        "settle",
    )

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
        self.closed = False
        self._final: UsageRecord | None = None  # the record journaled before the answer's last byte
        self._progress_at = 0.0

    # -- the journal -----------------------------------------------------------------------------------

    def dispatched(self) -> None:
        """The request is about to leave for the engine: from now on a crash still bills its prompt."""
        journal = self.billing.journal
        if journal is not None:
            p, engine = self.p, self.engine
            journal.opened(
                Dispatched(
                    p.record_id,
                    p.tenant,
                    p.model,
                    p.key_id,
                    engine.region,
                    engine.id,
                    p.request_id,
                    len(p.token_ids),
                    self.predicted,
                    time.time(),
                )
            )

    def streamed(self, tokens: int) -> None:
        """A stream's progress (called per relayed batch): journaled about once a second."""
        journal = self.billing.journal
        if journal is not None:
            now = time.monotonic()
            if now - self._progress_at >= PROGRESS_EVERY_S:
                self._progress_at = now
                journal.progressed(self.p.record_id, tokens)

    def usage_arrived(self, usage: dict[str, Any]) -> None:
        """The engine's final usage is in hand and about to be forwarded: the record is fixed (and
        journaled) now, before the last byte reaches the client. An engine that sends its usage chunk twice
        with other counts is billed for the last one (the journal's replay takes the last entry too)."""
        counts = credible_counts(usage)
        if counts is None:
            self._final = None  # (``done`` bills the request by the gateway's own counts)
            return
        prompt, cached, completion = counts
        final = self._final
        if (
            final is not None
            and (final.prompt_tokens, final.cached_tokens, final.completion_tokens) == counts
        ):
            return  # (the same usage chunk: this is called after every batch once it came)
        self._final = self._record(prompt, cached, completion, "completed", estimated=False)
        if self.billing.journal is not None:
            self.billing.journal.finished(self._final)

    def void(self) -> None:
        """Nothing of the request is billable (the engine failed before answering): no record."""
        if not self.closed:
            self.closed = True
            self.settle()
            self._unbilled()

    def _unbilled(self) -> None:
        if self.billing.journal is not None:
            self.billing.journal.voided(self.p.record_id)

    # -- the end -----------------------------------------------------------------------------------------

    def annotate(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self.billing.usage_extras(self.p.model, usage)

    def done(
        self, usage: dict[str, Any] | None, first_byte: float | None, outcome: Outcome, streamed_tokens: int
    ) -> None:
        if self.closed:
            return
        self.closed = True
        self.settle()
        p, engine = self.p, self.engine
        counts = credible_counts(usage) if usage is not None else None
        if usage is not None and counts is None:
            # Counts no engine can mean (negative, fractional, past any context) are no measure of what it
            # did, and could not be priced into the ledger's sums: billed as an answer without usage.
            self.metrics.upstream_error(engine.id, "malformed_usage")
            usage = None
        prompt, cached, completion = counts or (0, 0, 0)
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
        record = self._final
        if record is not None and outcome != record.status:
            # The usage came, but the stream then failed (no [DONE], broken off) or the client left: the
            # client was told it failed, so the record says so too, billing the usage's tokens all the same.
            record = dataclasses.replace(record, status=outcome)
        elif record is None and usage is not None:
            record = self._record(prompt, cached, completion, outcome, estimated=False)
        elif record is None:
            # It ended without the engine's usage: bill what the engine did by the gateway's own counts (the
            # prompt it sent, the cache it predicted, one token per streamed event or a whole answer's
            # generated text tokenized: gateway.tenancy.answer_tokens) — also when the client left before
            # the first byte: the engine took the prompt. (Where the engine failed before anything reached the
            # client, the relay raised instead and the request is voided: ``void``.)
            record = self._record(len(p.token_ids), self.predicted, streamed_tokens, outcome, estimated=True)
        if record is not self._final and self.billing.journal is not None:
            try:
                self.billing.journal.finished(record)  # (a whole answer leaves after this)
            except Exception:
                # The journal only guards against a crash; the record still goes to the ledger below.
                log.exception("the usage journal could not take record %s", record.record_id)
        self._log(outcome, now, first_byte, record.prompt_tokens, record.cached_tokens,
                  record.completion_tokens, record.cost_picodollars)  # fmt: skip
        self.billing.record(record)
        self.metrics.usage_recorded(record.status, record.estimated)
        # Admission charged the prompt the gateway saw and the budget; what the answer took past them is
        # charged now: the output of a chat sent without a budget, the history a continued Responses
        # request read on its engine (its prompt there, the gateway's only the new input), and the media of a
        # prompt whose text alone the gateway rendered (gateway.media).
        overrun = max(record.prompt_tokens - p.prompt_tokens, 0)
        overrun += max(record.completion_tokens - p.output_budget, 0)
        self.billing.charge_overrun(p.tenant, p.key_id, overrun)

    def _record(
        self, prompt: int, cached: int, completion: int, status: str, *, estimated: bool
    ) -> UsageRecord:
        p, engine = self.p, self.engine
        return UsageRecord(
            record_id=p.record_id,
            tenant=p.tenant,
            model=p.model,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            cost_picodollars=self.billing.cost_picodollars(p.model, prompt, cached, completion),
            status=status,
            key_id=p.key_id,
            region=engine.region,
            engine=engine.id,
            request_id=p.request_id,
            estimated=estimated,
        )

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
