"""The output budget: what the gateway caps, charges and bills is exactly what the engine will generate, per
endpoint (chat reads ``max_completion_tokens`` first, legacy completions only ``max_tokens``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest

from gateway.tenancy.tenants import create_key
from tests.harness import MODEL, ClusterFactory

PROMPT = "Count to ten, slowly."


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_max_completion_tokens_cannot_smuggle_a_larger_max_tokens_past_the_cap(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster({"eu-west": 1}, max_output_tokens=256)
    body = {"model": MODEL, "prompt": PROMPT, "max_completion_tokens": 1, "max_tokens": 1000}
    status, answer, _ = await cluster.post("/v1/completions", body)
    # /v1/completions has no max_completion_tokens (OpenAI refuses unknown arguments): the engine would read
    # max_tokens = 1000, past the 256 this gateway allows.
    assert status == 400, answer
    assert answer["error"]["param"] == "max_completion_tokens"
    status, answer, _ = await cluster.post("/v1/completions", {**body, "max_completion_tokens": None})
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    status, answer, _ = await cluster.post(
        "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 7}
    )
    assert status == 200 and answer["usage"]["completion_tokens"] == 7


async def test_chat_reads_max_completion_tokens_first_as_engines_do(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1}, max_output_tokens=256)
    messages = [{"role": "user", "content": PROMPT}]
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_completion_tokens": 1000,
        "max_tokens": 5,
    }
    status, answer, _ = await cluster.post("/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == "max_completion_tokens"
    body = {"model": MODEL, "messages": messages, "max_completion_tokens": 3, "max_tokens": 1000}
    status, answer, _ = await cluster.post("/v1/chat/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


async def test_a_completion_naming_no_budget_gets_the_default_explicitly(
    make_cluster: ClusterFactory,
) -> None:
    """An engine's own default must not decide a completion's budget: the gateway forwards the one it charged
    for (OpenAI's 16 unless configured)."""
    cluster = await make_cluster({"eu-west": 1}, default_max_tokens=5)
    status, answer, _ = await cluster.post("/v1/completions", {"model": MODEL, "prompt": PROMPT})
    assert status == 200 and answer["usage"]["completion_tokens"] == 5


async def test_a_chat_naming_no_budget_is_as_long_as_the_engine_makes_it(
    make_cluster: ClusterFactory,
) -> None:
    """OpenAI's chat, vLLM's and SGLang's write what the context leaves when no budget is named: the gateway
    sent its default_max_tokens (16) instead, cutting every such answer short with finish_reason "length".
    It now sends none (the simulated engine's own default is 16, not the 5 configured here), unless
    default_chat_max_tokens says otherwise."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    cluster = await make_cluster({"eu-west": 1}, default_max_tokens=5)
    status, answer, _ = await cluster.post("/v1/chat/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 16, answer
    configured = await make_cluster({"eu-west": 1}, default_max_tokens=5, default_chat_max_tokens=7)
    status, answer, _ = await configured.post("/v1/chat/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 7, answer


async def test_tokens_a_chat_generated_past_its_admission_charge_are_charged_after(
    make_cluster: ClusterFactory,
) -> None:
    """A chat without a budget is charged prompt + default_max_tokens at admission, then what it generated
    past that: the next request sees it gone from the allowance (less what refilled meanwhile)."""
    per_minute = 600
    cluster = await make_cluster(
        {"eu-west": 1},
        default_max_tokens=5,
        auth={"enabled": True},
        tenants={"t": {"tokens_per_minute": per_minute}},
    )
    key = (await create_key(cluster.gateway.billing.keys, "t"))[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    status, first, headers = await cluster.post("/v1/chat/completions", body, headers=bearer(key))
    started = time.monotonic()
    assert status == 200 and first["usage"]["completion_tokens"] == 16, first
    before = int(headers["x-ratelimit-remaining-tokens"])  # after its admission charge: prompt + 5
    status, answer, headers = await cluster.post(
        "/v1/chat/completions", {**body, "max_tokens": 5}, headers=bearer(key)
    )
    refilled = (time.monotonic() - started) * per_minute / 60 + 1
    assert status == 200, answer
    spent = before - int(headers["x-ratelimit-remaining-tokens"])
    charged = first["usage"]["prompt_tokens"] + 5 + 11  # this one's admission + the first one's overrun
    assert charged - refilled <= spent <= charged, (spent, charged, refilled)


async def test_tokens_per_minute_are_charged_by_the_budget_the_engine_will_use(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster(
        {"eu-west": 1}, auth={"enabled": True}, tenants={"small": {"tokens_per_minute": 300}}
    )
    key = (await create_key(cluster.gateway.billing.keys, "small"))[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200}
    status, answer, _ = await cluster.post("/v1/completions", body, headers=bearer(key))
    assert status == 200 and answer["usage"]["completion_tokens"] == 200
    # 200 more would pass 300 a minute: refused, however the request spells its budget.
    for spelled in ({"max_tokens": 200}, {"max_tokens": 200, "max_completion_tokens": 1}):
        status, answer, _ = await cluster.post(
            "/v1/completions", {"model": MODEL, "prompt": PROMPT, **spelled}, headers=bearer(key)
        )
        assert status in (400, 429), answer
        assert status == 429 or answer["error"]["param"] == "max_completion_tokens"


async def test_a_long_whole_answer_is_not_cut_at_the_engine_silence_limit(
    make_cluster: ClusterFactory,
) -> None:
    """A non-streamed answer is silent until it is done: its deadline comes from its budget, and cutting it
    at read_timeout_s would only have every engine start it over (and bill nobody)."""
    cluster = await make_cluster(
        {"eu-west": 2},
        sim={"decode_s_per_token": 0.01},
        read_timeout_s=0.5,
        resilience={"first_byte_timeout_s": 0.3, "s_per_output_token": 0.05},
    )
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100}  # about 1 s of decoding
    status, answer, headers = await cluster.post("/v1/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 100, answer
    assert headers["x-kvgate-route"] != "failover"


async def test_a_request_larger_than_the_whole_limit_says_so_and_the_sdk_does_not_retry(
    make_cluster: ClusterFactory,
) -> None:
    """No wait lets a request of more tokens than the tenant's whole minute pass. It said "Please try again
    in 60s" with Retry-After 60, and the OpenAI SDK slept a minute and sent it again, twice."""
    cluster = await make_cluster(
        {"eu-west": 1}, auth={"enabled": True}, tenants={"small": {"tokens_per_minute": 300}}
    )
    key = (await create_key(cluster.gateway.billing.keys, "small"))[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400}
    status, answer, headers = await cluster.post("/v1/completions", body, headers=bearer(key))
    assert status == 429 and answer["error"]["type"] == "tokens", answer
    message = answer["error"]["message"]
    assert "Request too large" in message and "Requested 4" in message and "must be reduced" in message
    assert "Retry-After" not in headers and "retry-after-ms" not in headers
    assert headers["x-should-retry"] == "false" and headers["x-ratelimit-limit-tokens"] == "300"
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=key)  # (its default: 2 retries)
    with pytest.raises(openai.RateLimitError):
        await asyncio.wait_for(
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400), timeout=30
        )
    await client.close()
