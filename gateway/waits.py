"""How long the gateway waits: for an engine to start answering (by its budget and its prompt's place in the
queue), and between attempts."""

from __future__ import annotations

import random

from gateway.config import GatewaySettings
from gateway.prepared import Prepared
from gateway.routing.route import Route


class Waits:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings

    def backoff_s(self, attempt: int) -> float:
        """Exponential, with jitter so that requests failed together do not retry together."""
        base = self.settings.resilience.retry_backoff_s * float(2**attempt)
        return base * (0.5 + random.random())

    def header_timeout_s(self, p: Prepared) -> float:
        """How long an engine may take to start answering: a stream's response header, or a whole answer.
        A whole answer gets ``s_per_output_token`` for each token of its budget and is not cut at the
        engine-silence limit: it is silent by nature until it is done, and cutting a long one short would
        only have another engine start it over (a frozen engine is failed over by its health instead)."""
        r = self.settings.resilience
        if p.stream:
            return min(r.first_byte_timeout_s, self.settings.read_timeout_s)
        # (A chat sent without a budget may write what the engine's context leaves: the largest budget.)
        budget = p.max_tokens if p.budget_named else self.settings.max_output_tokens
        return r.first_byte_timeout_s + budget * r.s_per_output_token

    def queue_wait_s(self, route: Route) -> float:
        """The prompt's estimated wait for its prefill (its own included), added to the first-byte limit:
        a known queue is no silence. kvgate's engines send a stream's header with its first token, so a
        request queued past the limit was failed over onto other full engines, and opened their breakers."""
        s = self.settings.routing.prefill_s_per_token
        return route.computing.queued_prefill_tokens(route.clock(), s) * s
