"""kvgate in front of two real vLLM engines (placeholder: the lead writes the real tests here). Run by
scripts/test-vllm; skipped, and not even collected, without its environment variables."""

from __future__ import annotations

import json
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.integration.conftest import VllmFleet


def test_both_engines_answer_models(vllm_fleet: VllmFleet) -> None:
    assert len(vllm_fleet.urls) == 2
    for url in vllm_fleet.urls:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            models = json.loads(resp.read())
        assert [m["id"] for m in models["data"]] == [vllm_fleet.model]
