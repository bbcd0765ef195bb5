"""The output budget: what the gateway caps, charges and bills is exactly what the engine will generate, per
endpoint (chat reads ``max_completion_tokens`` first, legacy completions only ``max_tokens``)."""

from __future__ import annotations

from typing import Any

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


async def test_the_default_budget_is_sent_to_the_engine_explicitly(make_cluster: ClusterFactory) -> None:
    """An engine's own default (vLLM's chat default is the whole context) must not decide the budget: the
    gateway forwards the one it charged for."""
    cluster = await make_cluster({"eu-west": 1}, default_max_tokens=5)
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    status, answer, _ = await cluster.post("/v1/chat/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 5
    status, answer, _ = await cluster.post("/v1/completions", {"model": MODEL, "prompt": PROMPT})
    assert status == 200 and answer["usage"]["completion_tokens"] == 5


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
