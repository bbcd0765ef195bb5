"""Tests against real third-party engines that `scripts/test-vllm` starts (two vLLM CPU engines with KV events
on). The normal suite never collects them: without ``KVGATE_VLLM_URLS`` nothing in this directory is even
imported. The environment variables are described at the top of scripts/test-vllm."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

if not os.environ.get("KVGATE_VLLM_URLS"):
    collect_ignore_glob = ["test_*.py"]


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


@pytest.fixture(scope="session")
def vllm_fleet() -> VllmFleet:
    urls = _split("KVGATE_VLLM_URLS")
    if not urls:
        pytest.skip("no vLLM engines (run scripts/test-vllm)")
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
    )
