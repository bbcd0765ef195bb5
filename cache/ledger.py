"""The usage ledger (contract 5): one record per finished request, exactly once, and per-tenant daily sums.

Costs are integers of pico-dollars (10^-12 $), so sums are exact: prices are per million tokens, and a price
with up to six decimals (``0.01875``) times a token count is a whole number of pico-dollars. A signed 64-bit
counter holds $9.2 million of them per tenant and day.
``cost = (prompt − cached)·input + cached·cached_input + completion·output``, where ``prompt`` counts the
cached tokens too (OpenAI's ``prompt_tokens`` includes ``prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import datetime as dt
import functools
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from decimal import Decimal
from typing import Any, Protocol

PICODOLLARS_PER_DOLLAR = 10**12
PRICE_DECIMALS = 6  # finer prices would make costs fractional pico-dollars
# More tokens than any model's context holds, in one count of one request's usage: an engine that reports
# more is wrong (an unset or wrapped counter), and its usage is not billed as it says.
MAX_USAGE_TOKENS = 10**8
# Dollars per million tokens, at most (a cent a token). With MAX_USAGE_TOKENS, a record costs at most
# 2·10^8 tokens x 10^4 $/M = 2·10^18 pico-dollars: inside the signed 64 bits of the ledger's sums, which
# a larger cost overflowed (the record then neither journaled nor written: its request a 500).
MAX_PRICE = Decimal(10_000)


@dataclass(frozen=True)
class Prices:
    """Dollars per million tokens."""

    input: Decimal
    cached_input: Decimal
    output: Decimal

    def cost_picodollars(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        if not 0 <= cached_tokens <= prompt_tokens or completion_tokens < 0:
            raise ValueError("need 0 <= cached_tokens <= prompt_tokens and completion_tokens >= 0")
        # $ per 1M tokens = 10^6 pico-dollars per token.
        picodollars = (
            (prompt_tokens - cached_tokens) * self.input
            + cached_tokens * self.cached_input
            + completion_tokens * self.output
        ) * 10**6
        return int(picodollars.to_integral_value())


def dollars(picodollars: int) -> float:
    return picodollars / PICODOLLARS_PER_DOLLAR


def day_of(ts: float) -> str:
    """The UTC day of a Unix time, ``2026-11-30``."""
    return day_name(int(ts // 86_400))


@functools.lru_cache(maxsize=64)
def day_name(day_number: int) -> str:
    """The UTC day ``day_number`` days after 1970-01-01, ``2026-11-30``."""
    return (dt.date(1970, 1, 1) + dt.timedelta(days=day_number)).isoformat()


@dataclass(frozen=True)
class UsageRecord:
    record_id: str  # unique per request (the gateway's, not the client's x-request-id): the idempotency key
    tenant: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_picodollars: int
    status: str = "completed"  # or "aborted": the client left after tokens streamed
    key_id: str = ""
    region: str = ""
    engine: str = ""
    request_id: str = ""  # the x-request-id, for correlating with logs
    estimated: bool = False  # token counts the gateway estimated (an aborted stream never got the usage)
    ts: float = field(default_factory=time.time)

    @property
    def day(self) -> str:
        return day_of(self.ts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> UsageRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


@dataclass
class DayTotals:
    day: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_picodollars: int = 0

    def add(self, rec: UsageRecord) -> None:
        self.requests += 1
        self.prompt_tokens += rec.prompt_tokens
        self.cached_tokens += rec.cached_tokens
        self.completion_tokens += rec.completion_tokens
        self.cost_picodollars += rec.cost_picodollars

    def merge(self, other: DayTotals) -> None:
        for name in COUNTER_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "cost_usd": dollars(self.cost_picodollars)}


COUNTER_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_picodollars")


class UsageLedger(Protocol):
    async def record(self, rec: UsageRecord) -> bool:
        """Write ``rec`` once: False (and nothing changes) if its ``record_id`` was recorded before."""
        ...

    async def record_many(self, recs: list[UsageRecord]) -> int:
        """``record`` for each, in one round trip where the store allows; how many were new. On an error
        any prefix of them may have been written (writing them again is safe)."""
        ...

    async def daily(self, tenant: str, start_day: str, end_day: str) -> list[DayTotals]:
        """The tenant's sums for every day in ``start_day .. end_day`` (inclusive) that has any."""
        ...

    async def tenants(self, start_day: str, end_day: str) -> dict[str, list[DayTotals]]:
        """Every tenant with usage in the range."""
        ...

    async def records(self, tenant: str | None = None, limit: int = 1000) -> list[UsageRecord]:
        """The most recent records, newest last (optionally one tenant's)."""
        ...


MAX_RANGE_DAYS = 366  # days one read of the ledger may span


def days_between(start_day: str, end_day: str) -> list[str]:
    """The days ``start_day .. end_day``, both included: at most ``MAX_RANGE_DAYS`` of them."""
    start, end = dt.date.fromisoformat(start_day), dt.date.fromisoformat(end_day)
    if end < start:
        raise ValueError("end is before start")
    # (366 days counted as the answer lists them, both ends in: a leap year whole, not a day past it)
    if (end - start).days + 1 > MAX_RANGE_DAYS:
        raise ValueError(f"at most {MAX_RANGE_DAYS} days at a time")
    return [(start + dt.timedelta(days=i)).isoformat() for i in range((end - start).days + 1)]


class MemoryLedger:
    """The ledger in process (the embedded default): the sums live as long as the gateway does; of the
    records themselves only the most recent ``keep_records`` (memory must not grow with traffic)."""

    def __init__(self, keep_records: int = 10_000) -> None:
        self._seen: dict[str, None] = {}  # insertion-ordered: the oldest ids are forgotten first
        self._keep_seen = keep_records * 10
        self._records: deque[UsageRecord] = deque(maxlen=keep_records)
        self._sums: dict[tuple[str, str], DayTotals] = {}

    async def record(self, rec: UsageRecord) -> bool:
        return self.record_now(rec)

    async def record_many(self, recs: list[UsageRecord]) -> int:
        return sum(map(self.record_now, recs))

    def record_now(self, rec: UsageRecord) -> bool:
        """``record`` without awaiting: nothing here can fail or wait."""
        if rec.record_id in self._seen:
            return False
        self._seen[rec.record_id] = None
        if len(self._seen) > self._keep_seen:
            del self._seen[next(iter(self._seen))]
        self._records.append(rec)
        self._sums.setdefault((rec.tenant, rec.day), DayTotals(rec.day)).add(rec)
        return True

    def __len__(self) -> int:
        return len(self._records)

    async def daily(self, tenant: str, start_day: str, end_day: str) -> list[DayTotals]:
        days = days_between(start_day, end_day)
        return [self._sums[(tenant, d)] for d in days if (tenant, d) in self._sums]

    async def tenants(self, start_day: str, end_day: str) -> dict[str, list[DayTotals]]:
        days = set(days_between(start_day, end_day))
        out: dict[str, list[DayTotals]] = {}
        for (tenant, day), totals in sorted(self._sums.items()):
            if day in days:
                out.setdefault(tenant, []).append(totals)
        return out

    async def records(self, tenant: str | None = None, limit: int = 1000) -> list[UsageRecord]:
        chosen = [r for r in self._records if tenant is None or r.tenant == tenant]
        return chosen[-limit:] if limit else []
