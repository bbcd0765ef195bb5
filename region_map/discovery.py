"""What a third-party engine says about itself, read from its own endpoints: pure parsing, no I/O.

kvgate's engines describe themselves on ``/health``; a stock vLLM answers ``/health`` with an empty 200, so
the gateway reads what it needs where those engines publish it:

- ``GET /v1/models`` (every OpenAI server): the model ids it serves. vLLM and SGLang list a LoRA adapter as
  an extra id whose ``parent`` is its base model.
- ``GET /metrics`` (Prometheus text): vLLM's ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` /
  ``vllm:kv_cache_usage_perc`` gauges and its ``vllm:cache_config_info`` labels (``block_size``,
  ``enable_prefix_caching``, ``prefix_caching_hash_algo``, ``num_gpu_blocks``); SGLang's
  ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs`` / ``sglang:token_usage``.
- ``GET /server_info`` (SGLang; ``/get_server_info`` before late 2025): its server arguments, among them
  ``page_size`` (SGLang's block size), ``disable_radix_cache`` and ``max_running_requests``.

Metric and label names were checked against vLLM 0.32.0 (``vllm/v1/metrics/loggers.py``, a running engine's
``/metrics``) and SGLang's ``srt/metrics/collector.py`` and ``srt/managers/scheduler_metrics_mixin.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from region_map.config import EngineKind


class DiscoveryError(ValueError):
    """An answer that does not have the shape its endpoint promises; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One entry of ``/v1/models``."""

    id: str
    parent: str | None = None  # a LoRA adapter's base model; None for a base model


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """Which of the engine's models the gateway routes to it, or why it must not route there at all."""

    model: str | None  # None exactly when ``error`` is set
    error: str | None = None  # a contradiction with the configuration: the engine is not healthy
    note: str | None = None  # a choice the operator should hear about (INFO), e.g. one of several models


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one ``/metrics`` scrape says; None wherever the text did not say it."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # fraction of KV blocks in use, 0-1
    block_size: int | None = None
    prefix_caching: bool | None = None
    hash_algo: str | None = None
    kv_capacity_blocks: int | None = None  # per data-parallel rank (vLLM's num_gpu_blocks)


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What SGLang's ``/server_info`` says that the gateway uses."""

    page_size: int | None = None
    prefix_caching: bool | None = None  # False: started with --disable-radix-cache
    max_running: int | None = None


def parse_models(payload: Any) -> list[ServedModel]:
    """The entries of an OpenAI ``/v1/models`` answer (``{"object": "list", "data": [{"id": ...}, ...]}``),
    in the engine's order. Raises DiscoveryError for any other shape."""
    data = payload.get("data") if isinstance(payload, Mapping) else None
    if not isinstance(data, list):
        raise DiscoveryError("/v1/models answered without a data list")
    models: list[ServedModel] = []
    for entry in data:
        model_id = entry.get("id") if isinstance(entry, Mapping) else None
        if not isinstance(model_id, str) or not model_id:
            raise DiscoveryError(f"/v1/models lists an entry without a string id: {entry!r:.200}")
        parent = entry.get("parent")
        # vLLM's base models carry "parent": null; a parent equal to the id itself is no adapter either.
        is_adapter = isinstance(parent, str) and parent != model_id
        models.append(ServedModel(model_id, parent if is_adapter else None))
    return models


def choose_model(served: Iterable[ServedModel], configured: str | None) -> ModelChoice:
    """The model the gateway routes to an engine that lists ``served``.

    A configured model the engine does not list is a contradiction: every request sent there under that name
    would come back 404, so the engine must not count as healthy. With none configured, the engine's first
    base model is taken (an adapter id routes only when the operator names it), and a choice among several is
    reported so that nobody wonders why the others 404.
    """
    models = list(served)
    ids = [m.id for m in models]
    if configured is not None:
        if configured in ids:
            return ModelChoice(configured)
        listed = ", ".join(ids) if ids else "no model at all"
        return ModelChoice(None, error=f"serves {listed}, not {configured} (the configured model)")
    if not models:
        return ModelChoice(None, error="/v1/models lists no model")
    bases = [m for m in models if m.parent is None] or models
    chosen = bases[0].id
    if len(models) == 1:
        return ModelChoice(chosen)
    adapters = [m.id for m in models if m.parent is not None]
    why = "the first that is not a LoRA adapter" if adapters else "the first it lists"
    note = (
        f'lists {", ".join(ids)}; routing it requests for {chosen} ({why}); set model = "..." for this '
        "engine to choose another"
    )
    return ModelChoice(chosen, note=note)


# The sample names each kind's load is read from, and how the series of several data-parallel ranks combine.
_VLLM_RUNNING = "vllm:num_requests_running"
_VLLM_WAITING = "vllm:num_requests_waiting"
_VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
_VLLM_CACHE_INFO = "vllm:cache_config_info"
_SGLANG_RUNNING = "sglang:num_running_reqs"
_SGLANG_WAITING = "sglang:num_queue_reqs"
_SGLANG_KV_USAGE = "sglang:token_usage"

_WANTED: dict[EngineKind, frozenset[str]] = {
    EngineKind.VLLM: frozenset({_VLLM_RUNNING, _VLLM_WAITING, _VLLM_KV_USAGE, _VLLM_CACHE_INFO}),
    EngineKind.SGLANG: frozenset({_SGLANG_RUNNING, _SGLANG_WAITING, _SGLANG_KV_USAGE}),
}
# The label that tells data-parallel ranks apart: vLLM's ``engine`` (the DP rank), SGLang's ``dp_rank``.
# Series that differ in any other label (SGLang's tp_rank and pp_rank when every scheduler reports) describe
# the same queue and are not added up.
_RANK_LABELS = ("engine", "dp_rank")


def parse_metrics(kind: EngineKind, text: str) -> EngineMetrics:
    """Load and cache facts from a vLLM or SGLang ``/metrics`` text.

    Running and waiting requests are summed over data-parallel ranks (each rank has its own queue); KV usage
    is their mean (each rank has its own cache, and a fraction does not add up). Raises DiscoveryError for
    text that is not Prometheus exposition format.
    """
    wanted = _WANTED.get(kind)
    if wanted is None:
        raise ValueError(f"no /metrics reading for engine kind {kind.value}")
    # A vLLM /metrics is ~50 kB of histograms; parsing only the few series read here takes a fraction of the
    # time of parsing all of them, and the health poller does this for every engine every interval.
    series = _samples(_only(text, wanted))
    if kind is EngineKind.VLLM:
        info = _cache_config(series.get(_VLLM_CACHE_INFO, []))
        return EngineMetrics(
            running=_count(series.get(_VLLM_RUNNING)),
            waiting=_count(series.get(_VLLM_WAITING)),
            kv_usage=_fraction(series.get(_VLLM_KV_USAGE)),
            block_size=_positive_int(info.get("block_size")),
            prefix_caching=_bool(info.get("enable_prefix_caching")),
            hash_algo=info.get("prefix_caching_hash_algo") or None,
            kv_capacity_blocks=_positive_int(info.get("num_gpu_blocks")),
        )
    return EngineMetrics(
        running=_count(series.get(_SGLANG_RUNNING)),
        waiting=_count(series.get(_SGLANG_WAITING)),
        kv_usage=_fraction(series.get(_SGLANG_KV_USAGE)),
    )


def parse_server_info(payload: Any) -> ServerInfo:
    """SGLang's ``/server_info`` (its server arguments merged with the scheduler's info)."""
    if not isinstance(payload, Mapping):
        raise DiscoveryError("/server_info answered with something other than a JSON object")
    radix_off = payload.get("disable_radix_cache")
    return ServerInfo(
        page_size=_positive_int(payload.get("page_size")),
        prefix_caching=(not radix_off) if isinstance(radix_off, bool) else None,
        max_running=_positive_int(payload.get("max_running_requests")),
    )


Series = dict[str, list[tuple[dict[str, str], float]]]


def _only(text: str, names: frozenset[str]) -> str:
    """The lines of ``text`` about the metrics ``names`` (their samples and their HELP and TYPE lines)."""
    kept: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in names:
                kept.append(line)
            continue
        end = len(line)
        for stop in ("{", " "):
            at = line.find(stop)
            if at != -1:
                end = min(end, at)
        if line[:end] in names:
            kept.append(line)
    return "\n".join(kept) + "\n"


def _samples(text: str) -> Series:
    series: Series = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:  # the parser's complaints about malformed lines
        raise DiscoveryError(f"/metrics is not Prometheus text: {exc}") from None
    return series


def _per_rank(samples: list[tuple[dict[str, str], float]] | None) -> list[float]:
    """One value per data-parallel rank: the largest of the rank's series (its TP/PP ranks repeat it)."""
    ranks: dict[tuple[str | None, ...], float] = {}
    for labels, value in samples or ():
        if not math.isfinite(value):
            continue
        rank = tuple(labels.get(name) for name in _RANK_LABELS)
        ranks[rank] = max(value, ranks.get(rank, value))
    return list(ranks.values())


def _count(samples: list[tuple[dict[str, str], float]] | None) -> int | None:
    """The ranks' gauges summed, None when there are none or their sum is no count (ranks each finite but
    summing past a float, 1e308 twice: round() of it raised OverflowError out of the health probe)."""
    values = _per_rank(samples)
    total = sum(values)
    return max(0, round(total)) if values and math.isfinite(total) else None


def _fraction(samples: list[tuple[dict[str, str], float]] | None) -> float | None:
    values = _per_rank(samples)
    return min(1.0, max(0.0, sum(values) / len(values))) if values else None


def _cache_config(samples: list[tuple[dict[str, str], float]]) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (one series per DP rank, alike but for ``engine``)."""
    for labels, _ in samples:
        if labels.get("block_size"):
            return labels
    return samples[0][0] if samples else {}


# More digits than any block size or block count has: int() of a string over 4300 digits raises ValueError
# (CPython's limit on int-string conversion), which escaped the health probe and failed the engine's check.
_MAX_INT_DIGITS = 18


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        value = value.strip()
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses (a ValueError that escaped
        # the health poller). vLLM writes an unset field as "None".
        if not (value.isascii() and value.isdigit()) or len(value) > _MAX_INT_DIGITS:
            return None
        value = int(value)
    return value if isinstance(value, int) and value > 0 else None


def _bool(value: str | None) -> bool | None:
    # vLLM writes its config fields with str(): "True" / "False".
    return {"true": True, "false": False}.get((value or "").strip().lower())
