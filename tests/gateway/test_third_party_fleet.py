"""A gateway in front of stock engines configured by URL and kind only: it discovers what they serve.

The engines are tests/third_party_engines.py's stand-ins of vLLM 0.32 (its /health, /v1/models, /metrics and
/tokenize as the real one answers them); scripts/test-vllm runs the same checks against real vLLM engines.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from cache.tokens import load_tokenizer
from gateway.tenancy.tenants import create_key
from tests.conftest import ThirdPartyFleet
from tests.models import make_bos_tokenizer_dir

URL_ONLY = {"model": None, "block_size": None}  # what the operator wrote: a URL and a kind


async def test_model_block_size_and_tokenizer_are_discovered_from_a_url_alone(
    third_party: ThirdPartyFleet,
) -> None:
    cluster, engines = await third_party(
        {"eu-west/v0": {"block_size": 32}}, engine_options={"eu-west/v0": URL_ONLY}
    )
    engine = cluster.gateway.fleet.engines["eu-west/v0"]
    assert engine.model == "tiny" and engine.block_size == 32 and engine.healthy
    assert cluster.gateway.fleet.models() == ["tiny"]
    await cluster.wait_for(lambda: engine.tokenizer_agrees is True)  # its /tokenize matched ours
    prompt = "an operator's prompt " * 20
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    for _ in range(2):
        status, answer, headers = await cluster.post("/v1/completions", body)
        assert status == 200, answer
    sent = engines["eu-west/v0"].bodies("/v1/completions")[-1]
    assert sent["prompt"] == [int(t) for t in cluster.gateway.prepare.tokenizer.encode(prompt)]
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(sent["prompt"]) - 1) // 32 * 32  # whole blocks, never the last prompt token
    assert int(headers["x-kvgate-predicted-cached-tokens"]) == cached


async def test_chat_to_vllm_carries_no_token_ids_and_predicts_its_cached_tokens(
    third_party: ThirdPartyFleet,
) -> None:
    cluster, engines = await third_party({"eu-west/v0": {}}, engine_options={"eu-west/v0": URL_ONLY})
    messages = [{"role": "system", "content": "a long shared system prompt " * 30},
                {"role": "user", "content": "hello"}]  # fmt: skip
    for _ in range(2):
        status, answer, headers = await cluster.post(
            "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2}
        )
        assert status == 200, answer
    sent = engines["eu-west/v0"].bodies("/v1/chat/completions")[-1]
    assert "prompt_token_ids" not in sent and "prompt" not in sent
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and int(headers["x-kvgate-predicted-cached-tokens"]) == cached


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_text_parts_and_developer_messages_are_rendered_as_the_engine_renders_them(
    third_party: ThirdPartyFleet, kind: str
) -> None:
    """vLLM joins a message's text parts with "\\n" and, for a template without the developer role, makes
    developer messages system ones merged into the first; SGLang joins the parts with " " and keeps the role.
    The gateway renders as the engines serving the model do, so it predicts their cache exactly."""
    cluster, _ = await third_party({"eu-west/e0": {"kind": kind}})
    # (Far more than a block apart either way: the "\\n"s add 99 bytes, the developer's merge saves 31.)
    messages = [
        {"role": "system", "content": "a long shared system prompt " * 10},
        {"role": "user", "content": [{"type": "text", "text": f"part {i}"} for i in range(100)]},
        {"role": "developer", "content": "answer in the user's language"},
        {"role": "user", "content": "and then?"},
    ]
    for _ in range(2):
        status, answer, headers = await cluster.post(
            "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2}
        )
        assert status == 200, answer
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and int(headers["x-kvgate-predicted-cached-tokens"]) == cached


async def test_a_configured_model_the_engine_does_not_serve_is_an_unhealthy_engine_not_a_404(
    third_party: ThirdPartyFleet,
) -> None:
    cluster, _ = await third_party({"eu-west/v0": {}}, engine_options={"eu-west/v0": {"model": "llama-70b"}})
    engine = cluster.gateway.fleet.engines["eu-west/v0"]
    assert not engine.healthy and "llama-70b" in (engine.last_error or "")
    async with cluster.session.get(cluster.url + "/health") as r:  # type: ignore[union-attr]
        health = await r.json()
    assert r.status == 503 and health["engines"][0]["last_error"] == engine.last_error


async def test_urls_alone_in_front_of_vllm_serve_requests_and_say_what_to_set(
    third_party: ThirdPartyFleet, caplog: pytest.LogCaptureFixture
) -> None:
    # The first try: a deployment file of URLs only (kind left at its default), in front of vLLM.
    # /health said ok and 2/2 healthy while /v1/models was empty and every request got 404.
    with caplog.at_level(logging.WARNING, "kvgate.health"):
        cluster, _ = await third_party(
            {"eu-west/v0": {}, "eu-west/v1": {}},
            engine_options={e: {**URL_ONLY, "kind": "kvgate"} for e in ("eu-west/v0", "eu-west/v1")},
        )
    assert cluster.gateway.fleet.models() == ["tiny"]
    status, answer, _ = await cluster.post(
        "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    )
    assert status == 200, answer
    said = [r.getMessage() for r in caplog.records if "not a kvgate engine" in r.getMessage()]
    assert len(said) == 2 and all('Set its kind ("vllm"' in m for m in said)


@pytest.mark.parametrize("auth", [True, False])
async def test_tenants_in_front_of_engines_without_cache_salt_are_warned_of_at_start(
    third_party: ThirdPartyFleet, caplog: pytest.LogCaptureFixture, auth: bool
) -> None:
    """SGLang takes no cache_salt: with tenants, their prefix caches are shared on it, and the operator is
    told which engines; vLLM engines keep tenants apart and are not named."""
    caplog.set_level(logging.WARNING, logger="kvgate.app")
    await third_party(
        {"eu-west/s": {"kind": "sglang"}, "eu-west/v": {"kind": "vllm"}}, auth={"enabled": auth}
    )
    said = [r.getMessage() for r in caplog.records if "cache_salt" in r.getMessage()]
    if auth:
        assert len(said) == 1 and "eu-west/s take no cache_salt" in said[0] and "eu-west/v" not in said[0]
    else:
        assert said == []


@pytest.mark.parametrize(
    ("tenant_salt", "client_salt"),
    [
        (None, "alice"),  # a client's own salt: joined to its tenant's, with a separator vLLM refused
        ("acme/prod", None),  # an operator's salt vLLM refuses ('/')
        (None, "end-user-" + "x" * 200),  # within the gateway's 256 characters, over vLLM's 128
        (None, "bob@example.com"),  # '@': refused by vLLM
    ],
)
async def test_every_salt_the_gateway_sends_vllm_is_one_it_takes_and_keeps_its_cache(
    third_party: ThirdPartyFleet, tenant_salt: str | None, client_salt: str | None
) -> None:
    """vLLM refuses a cache_salt over 128 characters or holding '@', '/', '\\' or NUL (400). The gateway
    sent "<n>:<tenant salt>/<client salt>" whenever a client sent a salt of its own: every such request to
    vLLM got a 400. Now such a namespace reaches vLLM as its digest, and the gateway hashes blocks with it."""
    cluster, engines = await third_party(
        {"eu-west/v0": {}}, auth={"enabled": True}, tenants={"acme": {"cache_salt": tenant_salt}}
    )
    key, _ = await create_key(cluster.gateway.billing.keys, "acme")
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0)
    extra = {"cache_salt": client_salt} if client_salt is not None else {}
    messages: Any = [{"role": "system", "content": "a long shared system prompt " * 30},
                     {"role": "user", "content": "hello"}]  # fmt: skip
    for _ in range(2):
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=2, extra_body=extra
        )
        answer = raw.parse()
    await client.close()
    sent = engines["eu-west/v0"].bodies("/v1/chat/completions")[-1]["cache_salt"]
    assert len(sent) <= 128 and not set(sent) & set("@/\\\0")
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached and int(raw.headers["x-kvgate-predicted-cached-tokens"]) == cached


@pytest.mark.parametrize("add_special_tokens", [None, False])
async def test_a_completions_text_is_encoded_with_the_special_tokens_vllm_adds(
    third_party: ThirdPartyFleet, tmp_path: Path, add_special_tokens: bool | None
) -> None:
    """vLLM encodes a completion's text with add_special_tokens (true by default): with a BOS-adding
    tokenizer (Llama's), its prompt was one token longer than the gateway's. The engine probe said the
    tokenizers disagreed (text, not ids, was sent), and every block the gateway hashed was shifted by one."""
    directory = make_bos_tokenizer_dir(tmp_path / "bos")
    cluster, engines = await third_party(
        {"eu-west/v0": {"tokenizer": load_tokenizer(directory)}}, tokenizer=str(directory)
    )
    engine = cluster.gateway.fleet.engines["eu-west/v0"]
    await cluster.wait_for(lambda: engine.tokenizer_agrees is not None)
    assert engine.tokenizer_agrees is True
    prompt = "the quick brown fox jumps over the lazy dog " * 12
    extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    for turn in range(2):
        body = {"model": "tiny", "prompt": prompt + f"turn {turn}", "max_tokens": 2, **extra}
        status, answer, headers = await cluster.post("/v1/completions", body)
        assert status == 200, answer
    sent = engines["eu-west/v0"].bodies("/v1/completions")[-1]["prompt"]
    bos = load_tokenizer(directory).with_special_tokens(np.empty(0, dtype=np.uint32)).tolist()
    assert (sent[: len(bos)] == bos) == (add_special_tokens is None)
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and int(headers["x-kvgate-predicted-cached-tokens"]) == cached
