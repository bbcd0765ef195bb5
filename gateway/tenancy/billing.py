"""Who is asking and what it costs: bearer key -> tenant, per-key rate limits, prices, and the one usage
record each answered request leaves in the ledger.

With authentication off (the default) every request belongs to the tenant ``default``, whose cache salt is
empty unless ``[tenants.default]`` sets one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache.journal import UsageJournal
from cache.ledger import MAX_USAGE_TOKENS, Prices, UsageLedger, UsageRecord, dollars
from gateway.config import KvgateConfig
from gateway.http.errors import AuthenticationFailed, RateLimited, Unavailable
from gateway.http.retry_after import retry_after_headers
from gateway.tenancy.ledger_writer import LedgerWriter
from gateway.tenancy.ratelimit import Allowance, LimitExceeded, RateLimiter
from gateway.tenancy.tenants import (
    Authenticator,
    KeyRecord,
    KeyStore,
    KeyStoreUnavailable,
    Tenant,
    bearer_key,
    tenant_from_config,
)

OPEN_TENANT = "default"
MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using "
    "Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
KEY_STORE_AWAY = "cannot verify the API key right now: the key store is unreachable; retry shortly"
KEY_STORE_RETRY_AFTER_S = 2


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: Tenant
    key: KeyRecord | None = None

    @property
    def key_id(self) -> str:
        return self.key.key_id if self.key is not None else ""

    @property
    def admin(self) -> bool:
        return self.tenant.admin


class Billing:
    def __init__(
        self,
        config: KvgateConfig,
        *,
        keys: KeyStore,
        ledger: UsageLedger,
        writer: LedgerWriter,
        limiter: RateLimiter,
    ) -> None:
        self.auth = config.gateway.auth
        self.keys = keys
        self.ledger = ledger
        self.writer = writer
        self.limiter = limiter
        self.authenticator = Authenticator(
            keys,
            cache_ttl_s=self.auth.cache_ttl_s,
            negative_ttl_s=self.auth.negative_ttl_s,
            fail_open=self.auth.fail_open,
            max_stale_s=self.auth.max_stale_s,
            lookup_timeout_s=self.auth.lookup_timeout_s,
        )
        self._tenant_configs = dict(config.tenants)
        self._tenants: dict[str, Tenant] = {}
        self._prices = {model: price.prices() for model, price in config.prices.items()}
        open_config = config.tenants.get(OPEN_TENANT)
        self._open = Caller(
            tenant_from_config(OPEN_TENANT, open_config)
            if open_config is not None
            else Tenant(OPEN_TENANT, "", admin=True)  # auth off: nobody to keep apart, anyone may read usage
        )

    # -- who ---------------------------------------------------------------------------------------------

    def tenant(self, name: str) -> Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = tenant_from_config(name, self._tenant_configs.get(name))
        return tenant

    async def identify(self, authorization: str | None) -> Caller:
        """The caller of a request with this Authorization header; 401 for a missing or unknown key, 503 (with
        Retry-After) when the key store cannot say whether the key is valid: never a 401 the key's owner
        would not retry."""
        if not self.auth.enabled:
            return self._open
        key = bearer_key(authorization)
        if key is None:
            raise AuthenticationFailed(MISSING_KEY)  # (code invalid_api_key, as for an unknown key)
        try:
            record = await self.authenticator.check(key)
        except KeyStoreUnavailable:
            headers = retry_after_headers(KEY_STORE_RETRY_AFTER_S)
            raise Unavailable(KEY_STORE_AWAY, code="auth_unavailable", headers=headers) from None
        if record is None:
            shown = f"{key[:6]}***{key[-4:]}" if len(key) > 12 else "***"
            raise AuthenticationFailed(f"Incorrect API key provided: {shown}.")
        return Caller(self.tenant(record.tenant), record)

    # -- limits ------------------------------------------------------------------------------------------

    async def admit_request(self, caller: Caller) -> dict[str, str] | None:
        """Charge one request against the caller's requests per minute, or raise 429. Called before the body
        is validated: a request refused as invalid costs its sender as much as any other. Returns OpenAI's
        ``x-ratelimit-*-requests`` headers when the caller has that limit, else None."""
        tenant = caller.tenant
        rpm = tenant.requests_per_minute or self.auth.requests_per_minute
        if not rpm:
            return None
        try:
            allowance = await self._spend(caller, "rpm", rpm, 1, "requests per min (RPM)", "requests")
        except RateLimited as exc:
            # OpenAI sends every limit's headers on a 429: the tokens' too, as this gateway last saw them.
            tpm = tenant.tokens_per_minute or self.auth.tokens_per_minute
            if tpm:
                exc.headers.update(
                    ratelimit_headers("tokens", self.limiter.allowance(_bucket(caller, "tpm"), tpm))
                )
            raise
        return ratelimit_headers("requests", allowance)

    async def admit_tokens(
        self, caller: Caller, prompt_tokens: int, max_tokens: int
    ) -> dict[str, str] | None:
        """Charge the caller's tokens per minute, or raise 429. Tokens count as prompt + max_tokens at
        admission (OpenAI's convention): what the answer could cost is known before it is generated. Returns
        OpenAI's ``x-ratelimit-*-tokens`` headers when the caller has that limit, else None."""
        tenant = caller.tenant
        tpm = tenant.tokens_per_minute or self.auth.tokens_per_minute
        if not tpm:
            return None
        amount = prompt_tokens + max_tokens
        allowance = await self._spend(caller, "tpm", tpm, amount, "tokens per min (TPM)", "tokens")
        return ratelimit_headers("tokens", allowance)

    def charge_overrun(self, tenant: str, key_id: str, tokens: int) -> None:
        """Charge tokens an answer used past what admission charged for it (a chat sent without a budget
        writes what the engine's context leaves; a continued Responses request reads its history on the
        engine) to the caller's tokens per minute: never refused, since they are spent, they come out of
        what the caller's next requests may take."""
        if tokens <= 0:
            return
        tpm = self.tenant(tenant).tokens_per_minute or self.auth.tokens_per_minute
        if tpm:
            self.limiter.debit(_bucket_of(key_id, tenant, "tpm"), tokens)

    async def admit_usage_read(self, caller: Caller) -> None:
        """Charge one read of the usage endpoints, or raise 429. Each read flushes the ledger writer and
        reads up to a year of the ledger, so it has its own allowance apart from the completions' (the read
        pays one request of the caller's request limit as well: ``admit_request``, by UsageApi)."""
        per_minute = self.auth.usage_reads_per_minute
        await self._spend(caller, "usage", per_minute, 1, "usage reads per min", None)

    async def _spend(
        self, caller: Caller, kind: str, per_minute: int, amount: int, what: str, unit: str | None
    ) -> Allowance:
        """Spend from the caller's ``kind`` bucket, or raise 429: OpenAI's body (``type``: "requests" or
        "tokens"; the message's wait exact, as OpenAI writes it: "try again in 120ms"), ``Retry-After`` in
        whole seconds rounded up and ``retry-after-ms`` exact, and with a ``unit`` the bucket's
        ``x-ratelimit-*-UNIT`` headers."""
        try:
            return await self.limiter.spend(_bucket(caller, kind), per_minute, amount, what)
        except LimitExceeded as exc:
            if exc.too_large:
                raise _too_large(caller, exc, unit) from None
            headers = retry_after_headers(exc.retry_after_s)
            if unit is not None:
                headers.update(ratelimit_headers(unit, exc.allowance))
            retry = reset_duration(int(headers["retry-after-ms"]) / 1000)  # (the wait the headers say)
            error = RateLimited(
                f"Rate limit reached for tenant {caller.tenant.name} on {exc}. Please try again in {retry}.",
                headers=headers,
            )
            error.type = unit or "requests"  # (OpenAI's 429s say which limit in ``type``)
            raise error from None

    # -- money -------------------------------------------------------------------------------------------

    def prices(self, model: str) -> Prices | None:
        return self._prices.get(model) or self._prices.get("*")

    def cost_picodollars(
        self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int
    ) -> int:
        prices = self.prices(model)
        return prices.cost_picodollars(prompt_tokens, cached_tokens, completion_tokens) if prices else 0

    def usage_extras(self, model: str, usage: dict[str, Any]) -> dict[str, Any]:
        """What the client's ``usage`` gains: ``cost`` in dollars (OpenRouter's convention) when the model
        has a price; nothing otherwise (and the engine's answer then passes through untouched)."""
        prices = self.prices(model)
        counts = credible_counts(usage) if prices is not None else None
        if prices is None or counts is None:
            return {}  # (no cost for made-up counts: the request is billed by the gateway's, see accounting)
        return {"cost": dollars(prices.cost_picodollars(*counts))}

    @property
    def journal(self) -> UsageJournal | None:
        """The crash journal of billable requests (with a Redis ledger; None in process)."""
        return self.writer.journal

    def record(self, rec: UsageRecord) -> None:
        """Hand a finished request's record to the ledger writer (never blocks, never drops)."""
        self.writer.submit(rec)


def _too_large(caller: Caller, exc: LimitExceeded, unit: str | None) -> RateLimited:
    """The 429 of a request larger than the caller's whole per-minute limit, as OpenAI words it. It names no
    wait, and ``x-should-retry: false`` tells the OpenAI SDKs not to retry: a ``Retry-After: 60`` had the
    Python SDK sleep a minute and try again, twice, for a request that can never pass."""
    headers = {"x-should-retry": "false"}
    if unit is not None:
        headers.update(ratelimit_headers(unit, exc.allowance))
    error = RateLimited(
        f"Request too large for tenant {caller.tenant.name} on {exc}. The input or output tokens must be "
        "reduced in order to run successfully.",
        headers=headers,
    )
    error.type = unit or "requests"
    return error


def _bucket(caller: Caller, kind: str) -> str:
    return _bucket_of(caller.key_id, caller.tenant.name, kind)


def _bucket_of(key_id: str, tenant: str, kind: str) -> str:
    """A key's bucket of one kind of limit; with no key (auth off), the tenant's."""
    return f"{key_id or tenant}:{kind}"


def ratelimit_headers(unit: str, allowance: Allowance) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-UNIT`` ("requests" or "tokens") for an allowance."""
    return {
        f"x-ratelimit-limit-{unit}": str(allowance.limit),
        f"x-ratelimit-remaining-{unit}": str(allowance.remaining),
        f"x-ratelimit-reset-{unit}": reset_duration(allowance.reset_s),
    }


def reset_duration(seconds: float) -> str:
    """A wait as OpenAI writes it (Go's duration format, to the millisecond, rounded up): ``0s``, ``20ms``,
    ``1s``, ``8.64s``, ``6m0s``, ``1h0m0s``."""
    ms = math.ceil(seconds * 1000 - 1e-6)  # (so that 1.0000000002 s is 1s, not 1.001s)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    head = f"{hours}h{minutes}m" if hours else f"{minutes}m" if minutes else ""
    return f"{head}{secs}s"


def usage_counts(usage: dict[str, Any] | None) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of an OpenAI usage object, a completion's or (``input_tokens``,
    ``output_tokens``) a Responses API one's; ``prompt`` includes the cached ones. A count that is not one
    (see ``usage_is_credible``) reads as zero."""
    if not usage:
        return 0, 0, 0
    prompt, cached, completion = (_count(value) for value in _raw_counts(usage))
    return prompt, min(cached, prompt), completion


def usage_is_credible(usage: dict[str, Any]) -> bool:
    """Whether an engine's usage gives its prompt tokens, and every count it gives (absent or null ones
    aside) is a whole number of tokens from 0 to ``MAX_USAGE_TOKENS``. One that is not (no prompt count,
    negative, fractional, a string, past any context) is no measure of the request: it is billed by the
    gateway's own counts instead, not as zero tokens."""
    return credible_counts(usage) is not None


def credible_counts(usage: dict[str, Any]) -> tuple[int, int, int] | None:
    """``usage_counts`` of a credible usage (see ``usage_is_credible``), None for any other: the check and
    the counts in one reading of the usage (the request path reads each usage two or three times)."""
    prompt, cached, completion = _raw_counts(usage)
    if prompt is None or not all(value is None or _is_count(value) for value in (prompt, cached, completion)):
        return None
    return prompt, min(cached or 0, prompt), completion or 0


def _raw_counts(usage: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(prompt, cached, completion) as the usage object gives them (None where it gives none)."""
    if "prompt_tokens" not in usage and "input_tokens" in usage:
        prompt, details, completion = "input_tokens", "input_tokens_details", "output_tokens"
    else:
        prompt, details, completion = "prompt_tokens", "prompt_tokens_details", "completion_tokens"
    cached = usage.get(details)
    cached = cached.get("cached_tokens") if isinstance(cached, dict) else None
    return usage.get(prompt), cached, usage.get(completion)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_USAGE_TOKENS


def _count(value: Any) -> int:
    return value if _is_count(value) else 0


def spool_path(config: KvgateConfig) -> Path:
    """``gateway.spool_path``, or one stable per region and port, so that a gateway restarted in place
    replays what it spooled before."""
    if config.gateway.spool_path:
        return Path(config.gateway.spool_path)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvgate" / f"ledger-{config.topology.region}-{config.gateway.port}.spool"
