"""Which engines' rendering the gateway follows for a model (gateway.prepare.chat_dialect): the gateway's
prediction of an engine's KV cache is exact only when it renders a chat as the engine does."""

from __future__ import annotations

import pytest

from cache.chat_dialect import SGLANG, VLLM, ChatDialect
from cache.chat_template import render_messages
from cache.tokens import ByteTokenizer
from gateway.prepare import chat_dialect
from region_map.config import EngineConfig, EngineKind
from region_map.fleet import EngineState
from tests.engine.test_engine_openai_api import AS_VLLM_RENDERS_IT, CHAT_WITH_PARTS_AND_A_DEVELOPER


def _engines(kinds: str) -> list[EngineState]:
    return [
        EngineState(
            id=f"r/e{i}",
            region="r",
            config=EngineConfig(name=f"e{i}", url="http://127.0.0.1:1", kind=EngineKind(kind)),
        )
        for i, kind in enumerate(kinds.split())
    ]


@pytest.mark.parametrize(
    ("kinds", "dialect"),
    [
        ("sglang", SGLANG),
        ("vllm", VLLM),
        ("kvgate", VLLM),
        ("openai", VLLM),  # an unknown OpenAI server: the most common convention
        ("sglang sglang vllm", SGLANG),
        ("sglang sglang kvgate openai", VLLM),  # a tie: vLLM's
        ("sglang vllm kvgate", VLLM),
        ("", VLLM),  # (no engine: the request is refused as an unknown model anyway)
    ],
)
def test_a_model_is_rendered_in_the_dialect_of_most_of_its_engines(kinds: str, dialect: ChatDialect) -> None:
    assert chat_dialect(_engines(kinds)) is dialect


def test_in_front_of_kvgate_engines_the_gateway_renders_as_they_do() -> None:
    # (tests/engine/test_engine_openai_api.py: kvgate's engine renders this chat so.)
    dialect = chat_dialect(_engines("kvgate kvgate"))
    assert (
        render_messages(ByteTokenizer(), CHAT_WITH_PARTS_AND_A_DEVELOPER, dialect=dialect)
        == AS_VLLM_RENDERS_IT
    )
