"""``GET /v1/usage`` (the caller's tenant) and ``GET /v1/admin/usage`` (every tenant; admin keys only).

``start`` and ``end`` are days (``2026-11-30``, or ``20261130``) or Unix seconds, both inclusive, in UTC;
both default to today. Figures are per day, with a total; costs in dollars and, exactly, in pico-dollars.
Reads have their own per-key allowance (``gateway.auth.usage_reads_per_minute``; 429 past it), and
identical reads at the same time share one.

A read is also a request: a key whose tenant has a request limit pays one for it, as for a completion, and
every answer after that (the read, a 400 for its query, a 503, a 429) carries OpenAI's
``x-ratelimit-*-requests`` headers. It pays before its query is validated, as a completion pays before its
body is: a key cannot send invalid reads for free.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from cache.ledger import DayTotals, day_of, days_between
from cache.redis_client import REDIS_FAILURES
from gateway.http.errors import GatewayError, InvalidRequest, PermissionDenied, Unavailable
from gateway.http.http_wire import json_response
from gateway.http.lean_request import LeanRequest
from gateway.state.single_flight import SingleFlight
from gateway.tenancy.billing import Billing, Caller

MAX_UNIX_S = 253_402_300_799  # 9999-12-31T23:59:59Z, the last second a date can name


class UsageApi:
    def __init__(self, billing: Billing) -> None:
        self.billing = billing
        self._reads: SingleFlight[tuple[str, str, str, str, int], Any] = SingleFlight()

    async def tenant_usage(self, request: LeanRequest) -> web.Response:
        caller = await self.billing.identify(request.headers.get("Authorization"))
        return await self._admitted(caller, functools.partial(self._tenant_usage, caller, request))

    async def _tenant_usage(self, caller: Caller, request: LeanRequest) -> web.Response:
        start, end = day_range(request.query)
        tenant = caller.tenant.name
        days = await self._read(
            ("tenant", tenant, start, end), lambda: self.billing.ledger.daily(tenant, start, end)
        )
        body = {"object": "usage", "tenant": tenant, "start": start, "end": end, **_days_and_total(days)}
        return json_response(body)

    async def admin_usage(self, request: LeanRequest) -> web.Response:
        caller = await self.billing.identify(request.headers.get("Authorization"))
        if not caller.admin:
            # (Before admission, as a 401 is: refused for who it is, whatever it asks, and reads nothing.)
            raise PermissionDenied("this key may only read its own tenant's usage (GET /v1/usage)")
        return await self._admitted(caller, functools.partial(self._admin_usage, request))

    async def _admin_usage(self, request: LeanRequest) -> web.Response:
        start, end = day_range(request.query)
        only = request.query.get("tenant")
        by_tenant = await self._read(
            ("admin", "", start, end), lambda: self.billing.ledger.tenants(start, end)
        )
        return json_response(usage_list(start, end, by_tenant, only))

    async def _admitted(self, caller: Caller, answer: Callable[[], Awaitable[web.Response]]) -> web.Response:
        """``answer()`` once the read is admitted: one request of the caller's request limit (a 429 with its
        headers past it), then one of its usage reads. With a request limit, whatever is answered after
        that says what is left of it, as a completion's answers do (``Billing.admit_request``)."""
        limits = await self.billing.admit_request(caller)
        try:
            await self.billing.admit_usage_read(caller)
            response = await answer()
        except GatewayError as exc:
            if limits is None:
                raise
            # A copy: a failed read's error is shared by every read that joined it (``_read``), each of
            # whose callers has its own allowance.
            raise exc.with_headers(limits) from None
        if limits is not None:
            response.headers.update(limits)
        return response

    async def _read(self, what: tuple[str, str, str, str], read: Any) -> Any:
        # Identical reads at the same time share one flush and one read of the ledger, as long as no record
        # was handed to the writer in between: a client reads its own writes.
        key = (*what, self.billing.writer.submitted)
        return await self._reads.run(key, functools.partial(self._flush_and_read, read))

    async def _flush_and_read(self, read: Any) -> Any:
        # Read your own writes: what this gateway has answered is in the ledger (or its spool) first.
        with contextlib.suppress(TimeoutError):
            await self.billing.writer.flush(timeout_s=2.0)
        try:
            return await read()
        except REDIS_FAILURES as exc:
            raise Unavailable(f"the usage ledger cannot be read right now: {exc}") from None


def day_range(query: Mapping[str, str]) -> tuple[str, str]:
    today = day_of(dt.datetime.now(dt.UTC).timestamp())
    end = _day(query.get("end"), "end") or today
    start = _day(query.get("start"), "start") or end
    try:
        days_between(start, end)
    except ValueError as exc:
        raise InvalidRequest(f"invalid range {start} .. {end}: {exc}", param="start") from None
    return start, end


def _day(raw: str | None, param: str) -> str | None:
    if raw is None or raw == "":
        return None
    if raw.isascii() and raw.isdigit():
        if len(raw) == 8:  # ISO 8601's basic form (20261207): Unix seconds that short are before 1973
            with contextlib.suppress(ValueError):
                return dt.date.fromisoformat(raw).isoformat()
        if len(raw) > 12 or int(raw) > MAX_UNIX_S:  # (the length first: int() of a huge string is slow)
            raise InvalidRequest(
                f"{param} is past the year 9999; Unix seconds go up to {MAX_UNIX_S}", param=param
            )
        return day_of(float(raw))
    try:
        return dt.date.fromisoformat(raw).isoformat()
    except ValueError:
        raise InvalidRequest(
            f"{param} must be a day (YYYY-MM-DD) or Unix seconds, not {raw[:40]!r}", param=param
        ) from None


def usage_list(
    start: str, end: str, by_tenant: Mapping[str, list[DayTotals]], only: str | None = None
) -> dict[str, Any]:
    """The answer of ``GET /v1/admin/usage``: every tenant's days (or ``only``'s) and their total. ``kvgate
    usage --json`` prints this shape, from a gateway or from Redis alike."""
    chosen = {name: days for name, days in by_tenant.items() if only is None or name == only}
    return {
        "object": "list",
        "start": start,
        "end": end,
        "data": [{"tenant": name, **_days_and_total(days)} for name, days in chosen.items()],
        "total": _sum(day for days in chosen.values() for day in days),
    }


def _days_and_total(days: list[DayTotals]) -> dict[str, Any]:
    return {"data": [{"object": "usage.day", **d.to_json()} for d in days], "total": _sum(days)}


def _sum(days: Any) -> dict[str, Any]:
    total = DayTotals("total")
    for d in days:
        total.merge(d)
    out = total.to_json()
    del out["day"]
    return out
