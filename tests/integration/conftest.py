"""Tests against real third-party engines that `scripts/test-vllm` starts (two vLLM CPU engines with KV events
on). The normal suite never collects them: without ``KVGATE_VLLM_URLS`` nothing in this directory is even
imported. The environment variables are described at the top of scripts/test-vllm."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.app import GATEWAY, build_app
from gateway.config import parse_config
from gateway.http.server import runner_for
from gateway.service import Gateway
from tests.serving import serve

if not os.environ.get("KVGATE_VLLM_URLS"):
    # Without engines, only the comparisons with vLLM's own code, and only when asked for: they need vLLM's
    # venv (KVGATE_VLLM_VENV), not an engine.
    collect_ignore_glob = (
        ["test_*.py"]
        if not os.environ.get("KVGATE_VLLM_VENV")
        else ["test_vllm_[fp]*.py", "test_vllm_embeddings.py"]
    )
elif os.environ.get("KVGATE_VLLM_MODE", "fleet") == "pd":  # engine 0 prefills, engine 1 decodes (NIXL)
    collect_ignore_glob = [
        "test_vllm_fleet.py",
        "test_vllm_responses*.py",
        "test_vllm_embeddings.py",
        "bench_*.py",
    ]
elif os.environ.get("KVGATE_VLLM_MODE") == "embed":  # two engines serving the model as an embedding model
    collect_ignore_glob = ["test_vllm_fleet.py", "test_vllm_responses*.py", "test_vllm_pd.py", "bench_*.py"]
else:  # two plain engines
    collect_ignore_glob = ["test_vllm_pd.py", "test_vllm_embeddings.py"]


def _split(name: str) -> list[str]:
    return [part for part in os.environ.get(name, "").split(",") if part]


@dataclass(frozen=True)
class VllmFleet:
    """The running engines, index i of each list describing engine i."""

    urls: list[str]  # http://127.0.0.1:PORT
    kv_events: list[str]  # tcp://127.0.0.1:PORT, the engine's PUB socket (it binds; subscribers connect)
    kv_replay: list[str]  # tcp://127.0.0.1:PORT, its replay ROUTER (send [b"", start seq as 8 bytes BE])
    topic: str
    model: str  # the served model name
    model_dir: Path  # tokenizer.json and tokenizer_config.json (chat template) of the served model
    block_size: int
    logs: Path | None
    restart: Path | None  # a script that restarts engine i: `restart-engine i` (returns once it is healthy)


def fleet_from_env() -> VllmFleet | None:
    """The engines scripts/test-vllm started, from its environment variables (None without them)."""
    urls = _split("KVGATE_VLLM_URLS")
    if not urls:
        return None
    logs = os.environ.get("KVGATE_VLLM_LOGS")
    return VllmFleet(
        urls=urls,
        kv_events=_split("KVGATE_VLLM_KV_EVENTS"),
        kv_replay=_split("KVGATE_VLLM_KV_REPLAY"),
        topic=os.environ.get("KVGATE_VLLM_KV_TOPIC", "kv-events"),
        model=os.environ.get("KVGATE_VLLM_MODEL", "tiny"),
        model_dir=Path(os.environ.get("KVGATE_VLLM_MODEL_DIR", "")),
        block_size=int(os.environ.get("KVGATE_VLLM_BLOCK_SIZE", "32")),
        logs=Path(logs) if logs else None,
        restart=Path(os.environ["KVGATE_VLLM_RESTART"]) if os.environ.get("KVGATE_VLLM_RESTART") else None,
    )


@pytest.fixture(scope="session")
def vllm_fleet() -> VllmFleet:
    fleet = fleet_from_env()
    if fleet is None:
        pytest.skip("no vLLM engines (run scripts/test-vllm)")
    return fleet


@contextlib.asynccontextmanager
async def gateway_in_front(
    fleet: VllmFleet,
    *,
    roles: Sequence[str] | None = None,
    engine_options: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[str, Gateway]]:
    """kvgate (in this process) in front of the engines, configured as an operator would: a URL, a kind and
    the engine's event endpoints (and ``engine_options``, e.g. tools); model, block size and load are
    discovered. Yields (its URL, the Gateway)."""
    engines: list[dict[str, Any]] = [
        {
            "name": f"v{i}",
            "url": url,
            "kind": "vllm",
            "role": (roles or ["both"] * len(fleet.urls))[i],
            **(engine_options or {}),
        }
        for i, url in enumerate(fleet.urls)
    ]
    for i, engine in enumerate(engines[: len(fleet.kv_events)]):  # none: the gateway's own routing records
        engine.update(kv_events_endpoint=fleet.kv_events[i], kv_events_topic=fleet.topic)
        if i < len(fleet.kv_replay):
            engine["kv_events_replay_endpoint"] = fleet.kv_replay[i]
    config = parse_config(
        {
            "region": "local",
            "regions": [{"name": "local", "engines": engines}],
            "gateway": {
                "tokenizer": str(fleet.model_dir),
                "health_interval_s": 0.2,
                "health_timeout_s": 10,  # two CPU engines on 2 shared cores answer slowly at times
                **settings,
            },
        }
    )
    app = build_app(config)
    runner = runner_for(app)
    url = await serve(runner)
    gateway = app[GATEWAY]
    try:
        yield url, gateway
    finally:
        await runner.cleanup()


async def until(predicate: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {within_s}s: {what}")
        await asyncio.sleep(0.05)


async def settled(gateway: Gateway, quiet_s: float = 0.15) -> None:
    """Until the engines' KV events stop arriving for ``quiet_s``: what they announced is in the index."""
    followers = gateway.metrics.event_followers
    last = -1
    while True:
        now = sum(f.batches for f in followers)
        if now == last:
            return
        last = now
        await asyncio.sleep(quiet_s)
