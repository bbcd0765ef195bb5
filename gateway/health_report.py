"""The gateway's health as ``/health`` reports it: whether an engine can answer, and for operators, the state
of Redis, the ledger, the usage journal and every engine."""

from __future__ import annotations

from aiohttp import web

from gateway.http.http_wire import json_response
from gateway.state.shared_state import SharedState
from gateway.tenancy.billing import Billing
from region_map.fleet import Fleet


class HealthReport:
    def __init__(self, fleet: Fleet, state: SharedState, billing: Billing) -> None:
        self.fleet = fleet
        self.state = state
        self.billing = billing

    def redis_status(self) -> str:
        """ "off" (no Redis configured), "on", or "unreachable": known without asking Redis (the last
        writes to it, shared state's and the ledger's, failed)."""
        if self.state.redis is None:
            return "off"
        return "unreachable" if self.state.writer.failing or self.billing.writer.degraded else "on"

    def journal_status(self) -> str:
        """ "off" (an in-process ledger needs no crash journal), "ok", or "failing" (the disk refuses it, or
        its files were removed: it then writes where no restart reads)."""
        journal = self.billing.journal
        if journal is None:
            return "off"
        return "failing" if journal.failing or journal.removed else "ok"

    def degraded(self) -> list[str]:
        """What of the gateway's own does not work as it should (it still serves): Redis away (sessions not
        shared, unknown keys refused), usage records spooled or held in memory, the crash journal refused."""
        reasons = []
        if self.redis_status() == "unreachable":
            reasons.append("redis_unreachable")
        if (ledger := self.billing.writer.state) != "ok":
            reasons.append(f"ledger_{ledger}")
        if self.journal_status() == "failing":
            reasons.append("journal_failing")
        return reasons

    def response(self, details: bool) -> web.Response:
        """200 while an engine is healthy, else 503: a load balancer keeps a gateway that can serve, degraded
        or not. The status says "degraded" (with ``details``, why) while one of its own parts fails."""
        healthy = sum(1 for e in self.fleet if e.healthy)
        status = 200 if healthy else 503
        degraded = self.degraded()
        said = "no_healthy_engine" if not healthy else "degraded" if degraded else "ok"
        if not details:
            return json_response({"status": said}, status=status)
        body = {
            "status": said,
            "degraded": degraded,
            "gateway_id": self.state.gateway_id,
            "region": self.fleet.region,
            "redis": self.redis_status(),
            "ledger": self.billing.writer.state,
            "journal": self.journal_status(),
            "engines_healthy": healthy,
            "engines_total": len(self.fleet),
            "engines": [e.describe() for e in self.fleet],
        }
        return json_response(body, status=status)
