"""Each kind of engine gets the gateway's additions in the fields it reads, and nothing it would ignore."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from gateway.http.engine_body import engine_body, prefill_only
from gateway.prepared import Prepared
from region_map.config import EngineConfig
from region_map.fleet import EngineState

IDS = np.arange(100, 140, dtype=np.uint32)


def prepared(path: str, body: dict[str, Any], *, stream: bool = False, shared: int = 0) -> Prepared:
    return Prepared(
        request_id="r1", tenant="acme", session_id=None, model="m", path=path, body=body, stream=stream,
        client_wants_usage=False, token_ids=IDS, chains={}, cache_salt="acme-salt", home_region="a",
        shared_tokens=shared,
    )  # fmt: skip


def engine(kind: str, **config: Any) -> EngineState:
    return EngineState(
        id="a/e", region="a", config=EngineConfig(name="e", url="http://127.0.0.1:1", kind=kind, **config)
    )


def sent(p: Prepared, e: EngineState, **kw: Any) -> dict[str, Any]:
    """The body as it goes on the wire."""
    return orjson.loads(orjson.dumps(engine_body(p, e, default_block_size=16, **kw),
                                     option=orjson.OPT_SERIALIZE_NUMPY))  # fmt: skip


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hello there"}


def test_kvgate_engines_get_ids_salt_and_shared_blocks_in_their_own_blocks() -> None:
    e = engine("kvgate", block_size=8)
    body = sent(prepared("/v1/chat/completions", CHAT, shared=32), e)
    assert body["prompt_token_ids"] == IDS.tolist()
    assert body["cache_salt"] == "acme-salt" and body["cache_shared_blocks"] == 4


def test_vllm_chat_gets_no_token_ids_it_would_ignore() -> None:
    e = engine("vllm")
    e.tokenizer_agrees = True
    body = sent(prepared("/v1/chat/completions", CHAT, stream=True), e)
    assert "prompt_token_ids" not in body and "prompt" not in body and body["messages"] == CHAT["messages"]
    assert body["cache_salt"] == "acme-salt"
    assert body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_completions_carry_ids_as_the_prompt_once_the_tokenizer_agrees(kind: str) -> None:
    e = engine(kind)
    assert sent(prepared("/v1/completions", TEXT), e)["prompt"] == "hello there"  # unchecked: text
    e.tokenizer_agrees = False
    assert sent(prepared("/v1/completions", TEXT), e)["prompt"] == "hello there"
    e.tokenizer_agrees = True
    assert sent(prepared("/v1/completions", TEXT), e)["prompt"] == IDS.tolist()
    # A client that sent ids gets them through whatever the tokenizer check said.
    e.tokenizer_agrees = None
    assert sent(prepared("/v1/completions", {"model": "m", "prompt": [5, 6]}), e)["prompt"] == IDS.tolist()
    e = engine(kind, accepts_token_ids=False)
    e.tokenizer_agrees = True
    assert sent(prepared("/v1/completions", TEXT), e)["prompt"] == "hello there"


def test_sglang_and_plain_openai_servers_get_no_fields_they_do_not_know() -> None:
    for kind in ("sglang", "openai"):
        body = sent(prepared("/v1/chat/completions", CHAT), engine(kind))
        assert set(body) == set(CHAT), kind
    e = engine("openai", accepts_token_ids=True)
    e.tokenizer_agrees = True
    assert sent(prepared("/v1/completions", TEXT), e)["prompt"] == IDS.tolist()
    assert "prompt" not in sent(prepared("/v1/chat/completions", CHAT), e)


def test_additions_come_last_and_the_prefill_half_is_one_whole_token() -> None:
    e = engine("vllm")
    params = {"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2]}}
    body = sent(prepared("/v1/chat/completions", {**CHAT, "max_tokens": 50, "stream": True}, stream=True), e,
                additions=params)  # fmt: skip
    assert body["kv_transfer_params"] == params["kv_transfer_params"] and body["max_tokens"] == 50
    half = prefill_only({**CHAT, "max_completion_tokens": 50, "stream": True, "stream_options": {"x": 1}})
    assert half["max_tokens"] == 1 and half["max_completion_tokens"] == 1
    assert half["stream"] is False and "stream_options" not in half


def test_a_client_cannot_make_vllm_reannounce_cached_blocks() -> None:
    xargs = {"kv_cache_report_mode": "full", "other": 1}
    body = sent(prepared("/v1/chat/completions", {**CHAT, "vllm_xargs": xargs}), engine("vllm"))
    assert body["vllm_xargs"] == {"other": 1} and xargs == {"kv_cache_report_mode": "full", "other": 1}
