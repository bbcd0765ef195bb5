"""The gateway's configuration: the ``[gateway]`` table of the deployment file, plus the topology.

One file configures a deployment; ``region_map`` validates the topology part, this module the rest.
Precedence: built-in defaults < the file < ``KVGATE_*`` environment variables < command-line flags.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cache.ledger import MAX_PRICE, PRICE_DECIMALS, Prices
from gateway.config_tables import AuthSettings, EdgeSettings, ResilienceSettings
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


def _check_cluster_url(url: str | None) -> None:
    """A Redis Cluster is reached over TCP and has database 0 only: say so at start, not at the first key."""
    if url is None:
        raise ValueError("redis_cluster = true needs redis_url: one node of the cluster (redis://host:port)")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "unix":
        raise ValueError("redis_cluster = true needs a redis:// or rediss:// URL: a cluster is not a socket")
    db = urllib.parse.parse_qs(parts.query).get("db", [parts.path.strip("/")])[0]
    if db not in ("", "0"):
        raise ValueError(
            f"redis_cluster = true: {without_credentials(url)!r} names database {db}; a Redis Cluster has "
            "database 0 only (keep deployments apart with redis_prefix)"
        )


class PriceConfig(BaseModel):
    """``[prices."model"]``: dollars per million tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # (At most MAX_PRICE: a request's cost must fit the ledger's sums.)
    input: Decimal = Field(ge=0, le=MAX_PRICE, decimal_places=PRICE_DECIMALS)
    cached_input: Decimal = Field(ge=0, le=MAX_PRICE, decimal_places=PRICE_DECIMALS)
    output: Decimal = Field(ge=0, le=MAX_PRICE, decimal_places=PRICE_DECIMALS)

    def prices(self) -> Prices:
        return Prices(self.input, self.cached_input, self.output)


# A TTL of a session, a response or a routing record goes to Redis in milliseconds with every write: past
# 2**63 ms Redis refuses the write ("value is not an integer or out of range"), and what it holds for the
# other gateways would be lost. Ten years.
MAX_TTL_S = 10 * 365 * 86400.0


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
    redis_cluster: bool = Field(
        default=False,
        description="redis_url is one node of a Redis Cluster: the gateway discovers the others and follows "
        "the cluster's redirections (a plain client would be refused every key another node serves)",
    )
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
        description="KV event messages larger than this are refused: vLLM/SGLang batches, live and replayed "
        "(ZMQ MAXMSGSIZE), and kvgate engines' snapshots and batches; the message is lost as a missed batch "
        "is, and the follower reconnects",
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
    max_prompts: int = Field(
        default=128,
        ge=1,
        description="prompts in one completion request; each is routed and sent as a request of its own",
    )
    max_embedding_inputs: int = Field(
        default=2048,
        ge=1,
        description="inputs in one embeddings request (OpenAI's limit); one engine embeds them all",
    )
    session_ttl_s: float = Field(default=3600.0, gt=0, le=MAX_TTL_S)
    response_ttl_s: float = Field(
        default=86400.0,
        gt=0,
        le=MAX_TTL_S,
        description="how long the gateways remember which engine keeps a stored Responses API response, "
        "restarted by each use (engines keep them until they restart or evict them)",
    )
    approx_ttl_s: float = Field(
        default=600.0, gt=0, le=MAX_TTL_S, description="residency guess for engines without events"
    )
    pending_ttl_s: float = Field(
        default=30.0,
        gt=0,
        le=MAX_TTL_S,
        description="residency guess for event engines until their event arrives",
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
        if self.redis_cluster:
            _check_cluster_url(self.redis_url)
        if self.operator_port and self.operator_port == self.port:
            raise ValueError(f"operator_port ({self.operator_port}) must differ from port: the public port")
        return self


_T = TypeVar("_T", bound=BaseModel)

ENV_OVERRIDES = {
    "KVGATE_HOST": "host",
    "KVGATE_PORT": "port",
    "KVGATE_REDIS_URL": "redis_url",
    "KVGATE_REDIS_PREFIX": "redis_prefix",
    "KVGATE_REDIS_CLUSTER": "redis_cluster",
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
