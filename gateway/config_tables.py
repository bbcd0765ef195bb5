"""The tables inside ``[gateway]`` of the deployment file: ``[gateway.auth]``, ``[gateway.resilience]`` and
``[gateway.edge]``. ``gateway.config`` reads the file and holds them in ``GatewaySettings``."""

from __future__ import annotations

import ipaddress
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class AuthSettings(BaseModel):
    """The ``[gateway.auth]`` table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=False, description="require Authorization: Bearer <key>")
    keys_file: str | None = Field(default=None, description="hashed keys (JSON lines) when there is no Redis")
    requests_per_minute: int | None = Field(default=None, ge=1, description="default per-key limit")
    tokens_per_minute: int | None = Field(default=None, ge=1, description="default per-key limit")
    usage_reads_per_minute: int = Field(
        default=60,
        ge=1,
        description="per key (per gateway when auth is off): reads of /v1/usage and /v1/admin/usage, each "
        "of which flushes this gateway's ledger writer and reads the ledger",
    )
    cache_ttl_s: float = Field(
        default=60.0, ge=0, description="a verified key is looked up again after this long (revocation delay)"
    )
    negative_ttl_s: float = Field(
        default=5.0, ge=0, description="how long the key store's 'no such key' is remembered"
    )
    lookup_timeout_s: float = Field(
        default=1.0, gt=0, description="a key look-up slower than this counts as the key store being away"
    )
    fail_open: bool = Field(
        default=True,
        description="while the key store is unreachable, keys this gateway verified before keep working "
        "(for up to max_stale_s past cache_ttl_s; a key revoked meanwhile works that long on this gateway); "
        "other keys get 503 either way, never 401",
    )
    max_stale_s: float = Field(
        default=900.0, ge=0, description="fail_open: how long past cache_ttl_s a verified key is still good"
    )


class ResilienceSettings(BaseModel):
    """The ``[gateway.resilience]`` table: timeouts, retries, circuit breakers, admission, draining."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    first_byte_timeout_s: float = Field(
        default=30.0, gt=0, description="an engine that sends no response header this long is failed over"
    )
    s_per_output_token: float = Field(
        default=0.25, ge=0, description="non-streaming answers also get this long per requested token"
    )
    max_attempts: int = Field(
        default=3, ge=1, le=10, description="engines tried while no byte reached the client"
    )
    retry_backoff_s: float = Field(default=0.02, ge=0, description="first pause between attempts (doubles)")
    breaker_failures: int = Field(default=3, ge=1, description="consecutive failures that open a breaker")
    breaker_cooldown_s: float = Field(
        default=5.0, gt=0, description="how long an open breaker skips the engine"
    )
    breaker_max_cooldown_s: float = Field(default=60.0, gt=0)
    max_inflight_per_engine: int = Field(
        default=1024, ge=1, description="admission: requests this gateway may have in flight to one engine"
    )
    max_waiting_per_engine: int = Field(
        default=256,
        ge=1,
        description="admission: an engine reporting this many queued requests takes no more",
    )
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="on shutdown, how long open requests and streams may still finish"
    )
    stall_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="once a stream's tokens flow, the longest silence before it ends with an error event",
    )
    unhealthy_silence_s: float = Field(
        default=1.0,
        gt=0,
        description="when an engine is declared unhealthy, its requests silent this long fail over at once",
    )

    @model_validator(mode="after")
    def _cooldowns(self) -> Self:
        # A failed trial doubles the cool-down up to the maximum: a first one above it would shrink instead.
        if self.breaker_cooldown_s > self.breaker_max_cooldown_s:
            raise ValueError(
                f"breaker_cooldown_s ({self.breaker_cooldown_s}) exceeds breaker_max_cooldown_s "
                f"({self.breaker_max_cooldown_s}): a failed trial would shorten the cool-down; raise "
                "breaker_max_cooldown_s too"
            )
        return self


class EdgeSettings(BaseModel):
    """The ``[gateway.edge]`` table: how long a client may take to send a request, and how many connections
    the public port keeps open. Reverse-proxy style defaults: the gateway may face the internet itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="request line and headers must arrive within this of the request's "
        "first byte, else 408 and the connection closes; a new connection's first byte within this of "
        "the accept, else it is closed",
    )
    body_timeout_s: float = Field(
        default=20.0,
        gt=0,
        description="the body's allowance from the end of the headers, before body_min_rate extends it",
    )
    body_min_rate: int = Field(
        default=64 * 1024,
        ge=0,
        description="bytes/s: every this many body bytes received extends the body's "
        "allowance by 1 s (mod_reqtimeout's MinRate); a client sending slower is cut off at about "
        "body_timeout_s; 0: body_timeout_s is all a body gets",
    )
    idle_timeout_s: float = Field(
        default=75.0,
        gt=0,
        description="a keep-alive connection with no request in progress is closed after this",
    )
    max_buffered_body_bytes: int = Field(
        default=256 << 20,
        ge=0,
        description="request bodies being read, on all connections together; past it a body gets 503 "
        "server_busy (lean_http's connections)",
    )
    max_connections: int = Field(
        default=10_000,
        ge=1,
        description="open client connections in all (then 503 at accept); never more than "
        "40% of the open-file soft limit, as each may hold an engine connection too",
    )
    max_connections_per_client: int = Field(
        default=256, ge=1, description="open connections per client address (IPv4 address, IPv6 /64)"
    )
    per_client_exempt: list[str] = Field(
        default_factory=lambda: ["127.0.0.0/8", "::1/128"],
        description="client networks (CIDR) without a per-client cap, only the total one: loopback (a local "
        "proxy, health checker or benchmark) and trusted reverse proxies, whose connections carry many "
        "clients",
    )

    @field_validator("per_client_exempt")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for network in value:
            ipaddress.ip_network(network, strict=False)  # ValueError: pydantic reports it with the field
        return value
