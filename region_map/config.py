"""The deployment file (TOML or YAML), validated with pydantic; every error names the key at fault.

```toml
region = "eu-west"                 # the region of the gateway reading this file

[[regions]]
name = "eu-west"
engines = [
  { name = "e0", url = "http://10.0.0.5:8000", role = "both", kv_capacity_blocks = 4096 },
  { name = "e1", url = "https://e1.eu-west.internal:8443" },   # TLS: see gateway.engine_tls_*
]

[rtt_ms]                           # symmetric; a missing pair uses default_rtt_ms
"eu-west.us-east" = 80
```
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    ValidationError,
    field_validator,
    model_validator,
)

from region_map.written_types import WrittenTypeError, check_written_types

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class ConfigError(ValueError):
    """A deployment file that cannot be used; the message names the offending key."""


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class EngineKind(StrEnum):
    """What serves behind an engine's URL: what the gateway may discover there and how it talks to it."""

    KVGATE = "kvgate"  # kvgate's own engine: /health reports everything, events over HTTP
    VLLM = "vllm"  # stock vLLM: /v1/models, /metrics, KV events over ZMQ, NixlConnector P/D
    SGLANG = "sglang"  # stock SGLang: /v1/models, /metrics, KV events over ZMQ, bootstrap P/D
    OPENAI = "openai"  # any other OpenAI server: model from /v1/models, approximate residency


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineConfig(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    url: HttpUrl
    kind: EngineKind = EngineKind.KVGATE
    role: Role = Role.BOTH
    kv_capacity_blocks: int = Field(default=0, ge=0, description="0: unknown, learnt from /health")
    model: str | None = Field(
        default=None, description="None: learnt from /health (kvgate) or /v1/models (other kinds)"
    )
    block_size: int | None = Field(
        default=None,
        ge=1,
        description="None: learnt from /health (kvgate), vllm:cache_config_info (vllm), else the gateway's",
    )
    kv_events: bool | None = Field(
        default=None,
        description="whether it publishes KV events; None: detect /v1/kv_events (kvgate), or yes when "
        "kv_events_endpoint is set (vllm, sglang)",
    )
    kv_events_endpoint: str | None = Field(
        default=None,
        description="vllm/sglang: the ZMQ address of its KV event publisher as the gateway reaches it "
        "(tcp://host:5557: the engine binds, the gateway connects), or where the gateway binds for an engine "
        "that connects (tcp://*:5557, as in vLLM's own notation)",
    )
    kv_events_replay_endpoint: str | None = Field(
        default=None, description="vllm: its replay ROUTER socket (tcp://host:5558); None: no replay"
    )
    kv_events_topic: str = Field(default="", description="the publisher's topic ('' takes every topic)")
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="data-parallel ranks behind the URL: rank r publishes on the endpoints' port + r",
    )
    bootstrap_port: int = Field(
        default=8998, ge=1, le=65535, description="sglang prefill engines: the P/D bootstrap server's port"
    )
    accepts_token_ids: bool | None = Field(
        default=None,
        description="send the prompt as token ids where the engine reads them; None: by kind (kvgate: "
        "always; vllm, sglang: /v1/completions only; openai: never)",
    )
    kv_pull: bool | None = Field(
        default=None,
        description="whether it pulls cached K/V from its region's peers and serves them; None: from /health",
    )
    tools: bool = Field(
        default=False,
        description="it calls tools (e.g. vLLM with --enable-auto-tool-choice): requests with tools go there",
    )

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_address(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"a ZMQ endpoint is tcp://host:port or ipc://path, not {value!r}")
        if value is not None and value.startswith("tcp://") and not value.rsplit(":", 1)[-1].isdigit():
            raise ValueError(f"a tcp:// ZMQ endpoint needs a port: {value!r}")
        return value

    @model_validator(mode="after")
    def _kind_fits(self) -> Self:
        if self.kv_events_endpoint is not None and self.kind not in (EngineKind.VLLM, EngineKind.SGLANG):
            raise ValueError(
                f"kv_events_endpoint is for kind vllm or sglang; this engine is {self.kind.value}"
            )
        if self.kind is EngineKind.OPENAI and self.kv_events:
            raise ValueError("an engine of kind openai publishes no KV events the gateway can read")
        endpoints = (self.kv_events_endpoint, self.kv_events_replay_endpoint)
        if self.data_parallel_size > 1 and any(e is not None and e.startswith("ipc://") for e in endpoints):
            # Rank r publishes on the endpoint's port + r: an ipc:// path has no port (vLLM refuses it too).
            raise ValueError("data_parallel_size > 1 needs tcp:// KV event endpoints (rank r uses port + r)")
        return self

    @field_validator("url", mode="before")
    @classmethod
    def _http_or_https(cls, url: Any) -> Any:
        # Said before pydantic's own parse, whose message for ftp://, unix:// ... does not say what to write.
        if isinstance(url, str) and "://" not in url and not url.lower().startswith(("http:", "https:")):
            # host:port, the commonest slip: pydantic says "relative URL without a base", or reads the host
            # as a scheme ("URL scheme should be 'http' or 'https'").
            raise ValueError(f"{url!r} has no scheme: write http://{url} (or https://{url} for TLS)")
        if isinstance(url, str) and "://" in url and url.split("://", 1)[0].lower() not in ("http", "https"):
            raise ValueError(
                f"an engine URL is http://host[:port] or https://host[:port] (TLS), not {url.split('://')[0]}://"
            )
        return url

    @field_validator("url")
    @classmethod
    def _no_path(cls, url: HttpUrl) -> HttpUrl:
        if url.path not in (None, "", "/"):
            raise ValueError("give the engine's base URL without a path (the gateway appends /v1/...)")
        if url.query or url.fragment or url.username or url.password:
            raise ValueError("give the engine's base URL alone: scheme, host and port (no query, user or #)")
        return url

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")


class RegionConfig(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    engines: list[EngineConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_engines(self) -> Self:
        names = [e.name for e in self.engines]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"engine names must be unique within a region; repeated: {', '.join(dupes)}")
        return self


class TopologyConfig(_Strict):
    region: str = Field(description="the region of the gateway reading this file")
    regions: list[RegionConfig] = Field(min_length=1)
    rtt_ms: dict[str, float] = Field(default_factory=dict, description='"a.b" = milliseconds, symmetric')
    default_rtt_ms: float = Field(default=50.0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError("region names must be unique")
        if self.region not in names:
            raise ValueError(f"region {self.region!r} is not one of the regions ({', '.join(names)})")
        for pair, ms in self.rtt_ms.items():
            ends = pair.split(".") if pair.count(".") == 1 else []
            if len(ends) != 2 or any(end not in names for end in ends):
                raise ValueError(f"rtt_ms key {pair!r} must be 'regionA.regionB' with two known regions")
            if ms < 0:
                raise ValueError(f"rtt_ms.{pair} must be >= 0")
        # One publisher per engine: a shared address would mix two engines' blocks (or, where the gateway
        # binds, fail to bind for the second one).
        seen: dict[str, str] = {}
        for region in self.regions:
            for engine in region.engines:
                endpoint = engine.kv_events_endpoint
                if endpoint is None:
                    continue
                here = f"{region.name}/{engine.name}"
                if endpoint in seen:
                    raise ValueError(f"engines {seen[endpoint]} and {here} have the same kv_events_endpoint")
                seen[endpoint] = here
        # One engine per URL and model (a copy-paste listing one twice was accepted): its one cache and queue
        # were counted as two engines', and a KV pull could send it to itself. A server of several models
        # behind one URL (an OpenAI upstream, vLLM's LoRA adapters) is listed once per model.
        urls: dict[tuple[str, str | None], str] = {}
        for region in self.regions:
            for engine in region.engines:
                model = engine.model
                here = f"{region.name}/{engine.name}"
                if (engine.base_url, model) in urls:
                    raise ValueError(
                        f"engines {urls[engine.base_url, model]} and {here} have the same url "
                        f"{engine.base_url}: list each engine once"
                    )
                urls[engine.base_url, model] = here
        return self

    def rtt_s(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        ms = self.rtt_ms.get(f"{a}.{b}", self.rtt_ms.get(f"{b}.{a}", self.default_rtt_ms))
        return ms / 1000.0


def format_validation_error(exc: ValidationError, root: str = "") -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in (root, *err["loc"]) if p != "")
        message = err["msg"]
        if err["type"] == "value_error":  # a validator's own sentence, without pydantic's "Value error, "
            message = str(err.get("ctx", {}).get("error", message))
        lines.append(f"{key}: {message}" if key else message)
    return "; ".join(lines)


def checked_as_written(model: type[BaseModel], data: object, root: str = "") -> None:
    """:func:`check_written_types` as a :class:`ConfigError`, for what a file wrote (not the environment)."""
    try:
        check_written_types(model, data, root)
    except WrittenTypeError as exc:
        raise ConfigError(str(exc)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a TOML (.toml) or YAML (.yaml/.yml) file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: {exc.strerror}") from None
    try:
        # UTF-8 whatever the locale: TOML is UTF-8 by definition. A file saved in another encoding (UTF-16 by
        # a Windows editor, Latin-1) was an "unexpected error: UnicodeDecodeError".
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{p}: not UTF-8 text (byte {exc.start} is {raw[exc.start : exc.start + 1]!r}): save it as UTF-8"
        ) from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = tomllib.loads(text)
    except ImportError:
        raise ConfigError(f"{p}: reading YAML needs PyYAML (pip install pyyaml), or use TOML") from None
    except Exception as exc:  # tomllib and yaml raise their own parse errors
        raise ConfigError(f"{p}: not valid {p.suffix.lstrip('.') or 'TOML'}: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a table/mapping")
    return data


def _one_line(exc: Exception) -> str:
    """A parse error in one line: PyYAML's spans several (each mark with the source line and a caret under
    it), which the one-line error of the command cut into pieces."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if isinstance(problem, str) and mark is not None:
        context = getattr(exc, "context", None)
        where = f"{context} " if isinstance(context, str) else ""
        return f"{where}{problem} (at line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


def parse_topology(data: Mapping[str, Any]) -> TopologyConfig:
    keys = ("region", "regions", "rtt_ms", "default_rtt_ms")
    topology = {k: data[k] for k in keys if k in data}
    checked_as_written(TopologyConfig, topology)
    try:
        return TopologyConfig.model_validate(topology)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
