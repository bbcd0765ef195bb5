"""The gateway's configuration: the ``[gateway]`` table of the deployment file, plus the topology.

One file configures a deployment; ``region_map`` validates the topology part, this module the rest.
Precedence: built-in defaults < the file < ``KVGATE_*`` environment variables < command-line flags.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cache.ledger import PRICE_DECIMALS, Prices
from gateway.routing.base import RoutingSettings
from gateway.routing.home import HomeSettings
from gateway.tenancy.tenants import TenantConfig, is_tenant_name
from gateway.user_errors import without_credentials
from region_map.config import (
    ConfigError,
    TopologyConfig,
    checked_as_written,
    format_validation_error,
    parse_topology,
    read_config_file,
)

TOPOLOGY_KEYS = frozenset({"region", "regions", "rtt_ms", "default_rtt_ms"})
TOP_LEVEL_KEYS = TOPOLOGY_KEYS | {"gateway", "tenants", "prices"}


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


def check_redis_url(url: str) -> str:
    """``url`` if it is a Redis URL that means what it says, else ValueError: redis-py takes other schemes
    for a bug of ours, and a database that is not a number for database 0."""
    shown = without_credentials(url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"{shown!r} is not a Redis URL: redis://[[user]:password@]host[:port][/db], rediss://... (TLS) "
            "or unix:///path/to/redis.sock?db=N"
        )
    try:
        parts.port  # noqa: B018  (raises ValueError for a port that is not a number)
    except ValueError:
        raise ValueError(f"{shown!r}: the port is not a number") from None
    path_db = parts.path.strip("/") if parts.scheme != "unix" else ""
    db = urllib.parse.parse_qs(parts.query).get("db", [path_db])[0]
    if db and not db.isdigit():
        raise ValueError(f"{shown!r}: the database {db!r} is not a number (redis://host:6379/0)")
    return url


class PriceConfig(BaseModel):
    """``[prices."model"]``: dollars per million tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: Decimal = Field(ge=0, decimal_places=PRICE_DECIMALS)
    cached_input: Decimal = Field(ge=0, decimal_places=PRICE_DECIMALS)
    output: Decimal = Field(ge=0, decimal_places=PRICE_DECIMALS)

    def prices(self) -> Prices:
        return Prices(self.input, self.cached_input, self.output)


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    operator_host: str = Field(default="127.0.0.1", description="where operator_port listens")
    operator_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="/metrics, /health and /dashboard without keys on a port of their own (and no longer "
        "/metrics and /dashboard on the public port); None: on the public port, admin keys only with auth on",
    )
    gateway_id: str | None = Field(
        default=None, description="unique per gateway; default <region>-<host>-<pid>"
    )
    redis_url: str | None = Field(default=None, description="shared state; None keeps everything in process")
    redis_prefix: str = Field(default="kvgate", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    redis_max_connections: int = Field(
        default=256,
        ge=2,
        description="size of the one Redis pool every Redis user of the gateway shares (the pub/sub follower "
        "holds one connection); when all are busy a command waits for one instead of failing",
    )
    block_size: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="tokens per KV block of engines that report none (kind openai, or a block_size-less "
        "/health); every other engine is hashed in its own block size",
    )
    min_block_size: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="engines whose own blocks are smaller (SGLang's pages of 1) are routed in blocks of this "
        "many tokens, a whole number of their pages, so that a prompt's hashing and lookup stay cheap; "
        "predicted cached tokens are then rounded down to it",
    )
    kv_event_max_message_bytes: int = Field(
        default=64 << 20,
        ge=1 << 20,
        description="vLLM/SGLang KV event messages (live and replayed) larger than this are refused (ZMQ "
        "MAXMSGSIZE): the message is lost as a missed batch is, and the follower reconnects",
    )
    tokenizer: str | None = Field(
        default=None, description="model directory with tokenizer.json; None: bytes"
    )
    max_body_bytes: int = Field(default=8 << 20, ge=1024)
    max_prompt_tokens: int = Field(default=1 << 20, ge=1)
    max_output_tokens: int = Field(default=1 << 17, ge=1, description="largest max_tokens a request may ask")
    default_max_tokens: int = Field(
        default=16,
        ge=1,
        description="max_tokens of a completion naming none (OpenAI's default), sent to the engine; what "
        "admission charges for a chat naming none",
    )
    default_chat_max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="max_tokens sent for a chat naming none; None sends none: the engine writes what its "
        "context leaves, as OpenAI's chat does",
    )
    max_session_id_length: int = Field(default=256, ge=1, le=4096)
    max_messages: int = Field(default=4096, ge=1, description="messages in one chat request")
    max_content_parts: int = Field(default=4096, ge=1, description="content parts in one chat request")
    session_ttl_s: float = Field(default=3600.0, gt=0)
    approx_ttl_s: float = Field(default=600.0, gt=0, description="residency guess for engines without events")
    pending_ttl_s: float = Field(
        default=30.0, gt=0, description="residency guess for event engines until their event arrives"
    )
    redis_max_approximate_per_engine: int = Field(
        default=200_000,
        ge=1,
        description="the Redis mirror keeps at most this many routing records (approx_ttl_s) per engine; "
        "the soonest to expire go first",
    )
    redis_sweep_interval_s: float = Field(
        default=30.0, gt=0, description="how often one gateway sweeps expired records from the Redis mirror"
    )
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=2.0, gt=0)
    unhealthy_after: int = Field(default=2, ge=1)
    connect_timeout_s: float = Field(default=3.0, gt=0)
    read_timeout_s: float = Field(default=600.0, gt=0, description="longest silence tolerated from an engine")
    # TLS to https:// engines (requests, health checks, KV events); certificates are always verified.
    engine_tls_ca_file: str | None = Field(
        default=None, description="PEM bundle of the CAs trusted for engines; None: the system's CAs"
    )
    engine_tls_cert_file: str | None = Field(
        default=None, description="the gateway's client certificate (PEM) for engines that require mTLS"
    )
    engine_tls_key_file: str | None = Field(
        default=None, description="its private key (PEM); None: in engine_tls_cert_file"
    )
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    home: HomeSettings = Field(default_factory=HomeSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    dashboard_interval_s: float = Field(default=2.0, gt=0, description="the dashboard's sampling period")
    access_log: bool = Field(default=True, description="one JSON line per finished request (kvgate.access)")
    lean_http: bool = Field(
        default=True,
        description="ignored, kept so that older configurations load: gateway.http.lean_http serves it all",
    )
    resilience: ResilienceSettings = Field(default_factory=ResilienceSettings)
    edge: EdgeSettings = Field(default_factory=EdgeSettings)
    shared_prefixes: list[str] = Field(
        default_factory=list, description="prompt prefixes (text) every tenant may share the KV cache of"
    )
    spool_path: str | None = Field(
        default=None,
        description="ledger spool while Redis is away; default: ledger-<region>-<port>.spool, state dir",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        return None if value is None else check_redis_url(value)

    @model_validator(mode="after")
    def _consistent(self) -> GatewaySettings:
        for name in ("default_max_tokens", "default_chat_max_tokens"):
            default = getattr(self, name)
            if default is not None and default > self.max_output_tokens:
                raise ValueError(
                    f"{name} ({default}) exceeds max_output_tokens ({self.max_output_tokens}): every "
                    "request that names no max_tokens would be refused"
                )
        if self.operator_port and self.operator_port == self.port:
            raise ValueError(f"operator_port ({self.operator_port}) must differ from port: the public port")
        return self


_T = TypeVar("_T", bound=BaseModel)

ENV_OVERRIDES = {
    "KVGATE_HOST": "host",
    "KVGATE_PORT": "port",
    "KVGATE_REDIS_URL": "redis_url",
    "KVGATE_REDIS_PREFIX": "redis_prefix",
    "KVGATE_GATEWAY_ID": "gateway_id",
    "KVGATE_TOKENIZER": "tokenizer",
    "KVGATE_BLOCK_SIZE": "block_size",
}


@dataclass(frozen=True)
class KvgateConfig:
    topology: TopologyConfig
    gateway: GatewaySettings
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    prices: dict[str, PriceConfig] = field(default_factory=dict)
    # Set by ``kvgate serve --workers N`` when no operator port is: where the workers share their metrics,
    # so that the public port's /metrics speaks for all of them (gateway.observability.worker_metrics).
    worker_metrics_dir: Path | None = None

    @property
    def gateway_id(self) -> str:
        return self.gateway.gateway_id or f"{self.topology.region}-{socket.gethostname()}-{os.getpid()}"


def parse_config(
    data: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> KvgateConfig:
    """Validate a whole deployment mapping; ``environ`` and ``overrides`` patch the ``[gateway]`` table."""
    unknown = sorted(set(data) - TOP_LEVEL_KEYS)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level key (known: {', '.join(sorted(TOP_LEVEL_KEYS))})")
    topology = parse_topology(data)
    raw_gateway = data.get("gateway", {})
    if not isinstance(raw_gateway, Mapping):
        raise ConfigError("gateway: must be a table")
    checked_as_written(GatewaySettings, raw_gateway, "gateway")
    merged = dict(raw_gateway)
    for var, key in ENV_OVERRIDES.items():
        if environ and var in environ:
            merged[key] = environ[var]
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        # Strings from the environment are coerced (lax mode); the file's own types were checked as written.
        gateway = GatewaySettings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, root="gateway")) from None
    tenants = _table(data, "tenants", TenantConfig)
    for name in tenants:
        if not is_tenant_name(name):
            raise ConfigError(f"tenants.{name}: a tenant name is 1-63 letters, digits, '_', '.' or '-'")
    return KvgateConfig(topology, gateway, tenants, _table(data, "prices", PriceConfig))


def _table(data: Mapping[str, Any], key: str, model: type[_T]) -> dict[str, _T]:
    raw = data.get(key, {})
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key}: must be a table")
    out = {}
    for name, value in raw.items():
        checked_as_written(model, value, f"{key}.{name}")
        try:
            out[str(name)] = model.model_validate(value)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, root=f"{key}.{name}")) from None
    return out


def load_config(
    path: str | Path,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> KvgateConfig:
    return parse_config(read_config_file(path), environ=environ, overrides=overrides)
