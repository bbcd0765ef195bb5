"""A completion with several prompts (``prompt: ["a", "b"]``, OpenAI's and vLLM's batch form): each prompt is
routed to where its own prefix is cached, billed as a request of its own, and the answers are joined as
vLLM joins them (gateway.prompt_batch, gateway.http.batch_stream)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.http.batch_stream import merge_headers, sum_usage
from tests.harness import MODEL, Cluster, ClusterFactory

BLOCK = 16
PRICE = {"input": "0.50", "cached_input": "0.05", "output": "1.50"}


def words(tag: str, count: int = 100) -> str:
    return " ".join(f"{tag}-{i}" for i in range(count))


async def engine_of(cluster: Cluster, prompt: str) -> str:
    status, body, headers = await cluster.post(
        "/v1/completions", {"model": cluster.model, "prompt": prompt, "max_tokens": 2}
    )
    assert status == 200, body
    return str(headers["x-kvgate-engine"])


async def two_prefixes_on_two_engines(cluster: Cluster) -> tuple[str, str, str, str]:
    """Two long prompts whose prefixes the gateway placed on different engines (least load spreads them)."""
    for attempt in range(10):
        a, b = words(f"alpha{attempt}"), words(f"beta{attempt}")
        engine_a = await engine_of(cluster, a)
        engine_b = await engine_of(cluster, b)
        if engine_a != engine_b:
            return a, engine_a, b, engine_b
    raise AssertionError("the two prefixes never landed on different engines")


async def real_cluster(make_cluster: ClusterFactory, model: Path) -> Cluster:
    """kvgate's engine on a tiny model (the simulated engine answers one choice only)."""
    return await make_cluster({"eu-west": 2}, real_model=model, tokenizer=str(model))


async def test_each_prompt_goes_to_the_engine_holding_its_prefix_and_the_answers_join_as_vllms(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    cluster = await real_cluster(make_cluster, tiny_model_dir)
    a, engine_a, b, engine_b = await two_prefixes_on_two_engines(cluster)
    first, second = a + " next", b + " next"
    singles = []
    for prompt in (first, second):
        status, single, _ = await cluster.post(
            "/v1/completions", {"model": cluster.model, "prompt": prompt, "max_tokens": 3}
        )
        assert status == 200
        singles.append(single["usage"]["prompt_tokens"])

    # (ignore_eos: a random model's sampled token may be its EOS, which ended a choice early now and then;
    # and the text of three random tokens may be empty, a partial UTF-8 character held back)
    body = {"model": cluster.model, "prompt": [second, first], "max_tokens": 3, "n": 2, "ignore_eos": True}
    status, answer, headers = await cluster.post("/v1/completions", body)
    assert status == 200, answer
    assert headers["x-kvgate-engine"] == f"{engine_b}, {engine_a}"
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" and isinstance(c["text"], str) for c in answer["choices"])
    usage = answer["usage"]
    assert usage["completion_tokens"] == 2 * 2 * 3
    assert usage["prompt_tokens"] == sum(singles)
    # Each prompt found its own prefix whole, on its own engine (its last token is always computed): the
    # sum of both, where one engine would have held only one of them.
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == sum((tokens - 1) // BLOCK * BLOCK for tokens in singles)
    assert headers["x-kvgate-predicted-cached-tokens"] == str(cached)
    assert headers["x-request-id"] and "," not in headers["x-request-id"]


async def test_token_id_prompts_and_the_sdk(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 2})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=[list(range(1, 40)), list(range(50, 70)), [7, 8, 9]], max_tokens=2
    )
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert completion.usage is not None and completion.usage.prompt_tokens == 39 + 20 + 3
    assert raw.headers["x-request-id"].startswith("req-")
    await client.close()


async def test_a_streamed_batch_is_one_stream_with_one_usage_chunk_and_one_done(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    cluster = await real_cluster(make_cluster, tiny_model_dir)
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    prompts = [words("s0", 40), words("s1", 60), words("s2", 20)]
    stream = await client.completions.create(
        model=cluster.model,
        prompt=prompts,
        max_tokens=4,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},  # every choice gets text: a sampled EOS would end one empty
    )
    chunks = [c async for c in stream]
    assert len({c.id for c in chunks}) == 1
    finished = [ch.index for c in chunks for ch in c.choices if ch.finish_reason is not None]
    assert sorted(finished) == list(range(6))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert sorted(texts) == list(range(6)) and all(texts.values())
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    usage = usage_chunks[0].usage
    assert usage is not None and usage.completion_tokens == 3 * 2 * 4
    whole = await client.completions.create(model=cluster.model, prompt=prompts, max_tokens=1)
    assert whole.usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens

    # Without include_usage: no usage chunk, and the stream still ends with one [DONE].
    assert cluster.session is not None
    body = {"model": cluster.model, "prompt": prompts[:2], "max_tokens": 3, "stream": True}
    async with cluster.session.post(cluster.url + "/v1/completions", json=body) as r:
        text = (await r.read()).decode()
    assert r.status == 200 and text.count("data: [DONE]") == 1 and text.endswith("data: [DONE]\n\n")
    assert '"usage"' not in text
    await client.close()


async def test_each_prompt_is_billed_as_a_request_of_its_own(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 2}, prices={MODEL: PRICE})
    prompts = [words("bill0"), words("bill1", 30)]
    status, answer, headers = await cluster.post(
        "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 3}
    )
    assert status == 200
    await cluster.gateway.billing.writer.flush()
    records = await cluster.gateway.billing.ledger.records()
    assert len(records) == 2 and len({r.record_id for r in records}) == 2
    assert sorted(r.request_id for r in records) == [f"{headers['x-request-id']}-{i}" for i in (0, 1)]
    assert sum(r.prompt_tokens for r in records) == answer["usage"]["prompt_tokens"]
    assert sum(r.completion_tokens for r in records) == answer["usage"]["completion_tokens"]
    cost = sum(r.cost_picodollars for r in records)
    assert cost > 0 and answer["usage"]["cost"] == pytest.approx(cost / 10**12, rel=1e-12)


async def test_a_prompt_its_engine_refuses_fails_the_batch_and_stops_the_others(
    make_cluster: ClusterFactory,
) -> None:
    # The engines take 300 tokens (prompt and answer); the gateway more: the engine refuses the long prompt.
    cluster = await make_cluster({"eu-west": 1}, sim={"max_model_len": 300, "decode_s_per_token": 0.05})
    sim = cluster.sim("eu-west/e0")
    for stream in (False, True):
        body = {"model": MODEL, "prompt": ["short", words("long", 200)], "max_tokens": 100, "stream": stream}
        status, answer, headers = await cluster.post("/v1/completions", body, headers={"x-request-id": "b-7"})
        assert status == 400 and "error" in answer, answer
        assert headers["x-request-id"] == "b-7"  # the client's id, not its prompt's ("b-7-1")
        await cluster.wait_for(lambda: sim.running == 0)  # the short prompt's 5 s answer was stopped
        await cluster.wait_for(lambda: cluster.gateway.fleet.engines["eu-west/e0"].inflight == 0)
    await cluster.gateway.billing.writer.flush()
    records = await cluster.gateway.billing.ledger.records()
    # The engine had taken the short prompt: billed as aborted, for its prompt (the refused one: nothing).
    assert [(r.request_id, r.status) for r in records] == [("b-7-0", "aborted")] * 2
    assert all(r.prompt_tokens > 0 for r in records)


async def test_a_client_that_leaves_a_streamed_batch_stops_every_prompt(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 2}, sim={"decode_s_per_token": 0.05})
    assert cluster.session is not None
    sims = [cluster.sim("eu-west/e0"), cluster.sim("eu-west/e1")]
    body = {"model": MODEL, "prompt": [words("x0", 50), words("x1", 50)], "max_tokens": 1000, "stream": True}
    response = await cluster.session.post(cluster.url + "/v1/completions", json=body)
    await response.content.readany()
    assert sum(s.running for s in sims) == 2
    response.close()
    await cluster.wait_for(lambda: sum(s.running for s in sims) == 0)
    await cluster.wait_for(lambda: all(e.inflight == 0 for e in cluster.gateway.fleet))


async def test_a_client_that_leaves_a_whole_batch_stops_every_prompt(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1}, sim={"decode_s_per_token": 0.05})
    assert cluster.session is not None
    sim = cluster.sim("eu-west/e0")
    body = {"model": MODEL, "prompt": ["a b c", "d e f", "g h i"], "max_tokens": 1000}
    request = asyncio.create_task(cluster.session.post(cluster.url + "/v1/completions", json=body))
    await cluster.wait_for(lambda: sim.running == 3)
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request
    await cluster.wait_for(lambda: sim.running == 0)
    await cluster.wait_for(lambda: cluster.gateway.fleet.engines["eu-west/e0"].inflight == 0)


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        (["a"] * 129, "prompt holds 129 prompts; this gateway allows at most 128"),
        (["a", ""], "prompt 1: the prompt must not be empty"),
        ([[1, 2], []], "prompt 1: the prompt must not be empty"),
        (["a", [1, 2]], "prompt"),
    ],
)
async def test_a_batch_the_gateway_refuses_says_which_prompt(
    make_cluster: ClusterFactory, prompt: list[Any], says: str
) -> None:
    cluster = await make_cluster({"eu-west": 1})
    status, answer, _ = await cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt})
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert says in answer["error"]["message"]


def test_the_batchs_headers_list_each_prompts_engine_and_sum_the_prediction() -> None:
    predicted, pull = "x-kvgate-predicted-cached-tokens", "x-kvgate-kv-pull-from"
    parts = [
        {"x-request-id": "r-0", "x-kvgate-engine": "eu/e0", predicted: "32", "h": "1"},
        {"x-request-id": "r-1", "x-kvgate-engine": "eu/e1", predicted: "16", "h": "1"},
        {"x-request-id": "r-2", "x-kvgate-engine": "eu/e0", predicted: "0", "h": "1", pull: "e1"},
    ]
    merged = merge_headers(parts, "r")
    assert merged == {
        "x-request-id": "r",
        "x-kvgate-engine": "eu/e0, eu/e1, eu/e0",
        "x-kvgate-predicted-cached-tokens": "48",
        "h": "1",
        "x-kvgate-kv-pull-from": "e1",
    }


def test_usage_sums_field_by_field_and_cost_without_float_dust() -> None:
    usages = [
        {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12, "cost": 4.61e-05,
         "prompt_tokens_details": {"cached_tokens": 8}, "completion_tokens_details": None},
        {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "cost": 4.6e-05,
         "prompt_tokens_details": {"cached_tokens": 0}},
    ]  # fmt: skip
    assert sum_usage(usages) == {
        "prompt_tokens": 15,
        "completion_tokens": 5,
        "total_tokens": 20,
        "cost": 9.21e-05,
        "prompt_tokens_details": {"cached_tokens": 8},
        "completion_tokens_details": None,
    }


async def test_a_batch_sent_with_a_session_still_sends_each_prompt_to_its_own_prefix(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    # Every prompt carried the session: the parts, dispatched at once, claimed and moved one binding between
    # them, and the prompts after the first followed it away from the engines holding their prefixes.
    cluster = await real_cluster(make_cluster, tiny_model_dir)
    a, engine_a, b, engine_b = await two_prefixes_on_two_engines(cluster)
    for session in ({"x-session-affinity": "batch-1"}, {}):
        prompts = [a + " again", b + " again"]
        body: dict[str, Any] = {"model": cluster.model, "prompt": prompts, "max_tokens": 2}
        if not session:
            body["prompt_cache_key"] = "batch-2"  # (OpenAI's way to name it, in the body)
        status, answer, headers = await cluster.post("/v1/completions", body, headers=session)
        assert status == 200, answer
        assert headers["x-kvgate-engine"] == f"{engine_a}, {engine_b}", session
        # Each found its own prefix (100 words, placed alone before) whole: where one engine held both, the
        # prompt sent to the other engine would have found nothing.
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert headers["x-kvgate-predicted-cached-tokens"] == str(cached)
        assert cached >= 2 * (answer["usage"]["prompt_tokens"] // 2 - 2 * BLOCK)
