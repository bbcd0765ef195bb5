"""The whole path: client -> gateway -> simulated engines, over real HTTP, with real KV events."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from cache.chat_template import render_chat
from tests.faulty_engines import Recorder
from tests.harness import MODEL, ClusterFactory
from tests.models import make_tokenizer_dir

BLOCK = 16


def system_prompt(tag: str, words: int = 120) -> str:
    return f"[{tag}] " + " ".join(f"rule-{tag}-{i}" for i in range(words))


def chat(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}


async def test_a_conversation_with_session_affinity_hits_the_cache(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster()
    session = {"x-session-affinity": "conversation-1"}
    turn1 = [{"role": "system", "content": system_prompt("a")}, {"role": "user", "content": "first question"}]
    status, body1, headers1 = await cluster.post("/v1/chat/completions", chat(turn1), headers=session)
    assert status == 200, body1
    engine = headers1["x-kvgate-engine"]
    assert headers1["x-kvgate-region"] == engine.split("/")[0]
    prompt1 = body1["usage"]["prompt_tokens"]

    answer = body1["choices"][0]["message"]["content"]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and a second one"},
    ]
    status, body2, headers2 = await cluster.post("/v1/chat/completions", chat(turn2), headers=session)
    assert status == 200, body2
    assert headers2["x-kvgate-engine"] == engine
    assert headers2["x-kvgate-route"] == "session"
    cached = body2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (prompt1 // BLOCK) * BLOCK > 0
    assert int(headers2["x-kvgate-predicted-cached-tokens"]) >= (prompt1 // BLOCK) * BLOCK


async def test_without_the_header_a_shared_prefix_still_finds_its_engine(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster({"eu-west": 4})
    homes: dict[str, str] = {}
    for tag in "abcdef":
        status, body, headers = await cluster.post(
            "/v1/chat/completions", chat([{"role": "system", "content": system_prompt(tag)}])
        )
        assert status == 200, body
        homes[tag] = headers["x-kvgate-engine"]
    assert len(set(homes.values())) > 1, "new prompts should spread over idle engines"
    for tag in "abcdef":
        messages = [
            {"role": "system", "content": system_prompt(tag)},
            {"role": "user", "content": "more text " * 5},
        ]
        status, body, headers = await cluster.post("/v1/chat/completions", chat(messages))
        assert status == 200, body
        assert headers["x-kvgate-engine"] == homes[tag]
        assert headers["x-kvgate-route"] == "prefix"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * BLOCK


async def test_kv_events_reach_the_gateway_view(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 2})
    status, _, headers = await cluster.post(
        "/v1/completions", {"model": MODEL, "prompt": "x" * 200, "max_tokens": 4}
    )
    assert status == 200
    engine = headers["x-kvgate-engine"]
    state = cluster.gateway.state
    # The engine's stored events turn the gateway's provisional record into exact entries.
    for _ in range(100):
        held = await state.index.holdings(engine)
        if len(held.exact) >= 200 // BLOCK:
            break
        await asyncio.sleep(0.02)
    assert len(held.exact) >= 200 // BLOCK and held.seq is not None and held.seq >= 1


async def test_an_overloaded_engine_loses_the_session_and_the_binding_follows(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster(
        {"eu-west": 3}, sim={"max_running": 1, "decode_s_per_token": 0.01}, routing={"max_waiting": 2}
    )
    session = {"x-session-affinity": "busy-session"}
    turn = [{"role": "system", "content": system_prompt("busy")}, {"role": "user", "content": "hi"}]
    status, _, headers = await cluster.post("/v1/chat/completions", chat(turn), headers=session)
    assert status == 200
    home = headers["x-kvgate-engine"]
    url = cluster.engines[home][1]

    # Flood the session's engine directly (not through the gateway) until its queue trips the guard.
    assert cluster.session is not None
    flood = [
        asyncio.create_task(
            cluster.session.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": "z", "max_tokens": 100}
            )
        )
        for _ in range(4)
    ]
    try:
        await cluster.wait_for(lambda: cluster.gateway.fleet.engines[home].load.waiting >= 2)
        status, _, headers = await cluster.post("/v1/chat/completions", chat(turn), headers=session)
        assert status == 200
        moved_to = headers["x-kvgate-engine"]
        assert moved_to != home and headers["x-kvgate-route"] == "moved"
        binding = cluster.gateway.state.sessions.get_now("default", "busy-session")
        assert binding is not None and binding.engine == moved_to
        status, _, headers = await cluster.post("/v1/chat/completions", chat(turn), headers=session)
        assert headers["x-kvgate-engine"] == moved_to and headers["x-kvgate-route"] == "session"
    finally:
        for task in flood:
            task.cancel()
        for response in await asyncio.gather(*flood, return_exceptions=True):
            if isinstance(response, aiohttp.ClientResponse):
                response.release()


async def test_streaming_through_the_openai_sdk(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 2})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": system_prompt("sdk")},
        {"role": "user", "content": "stream please"},
    ]
    headers = {"x-session-affinity": "sdk-session"}

    chunks = [
        c
        async for c in await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            stream=True,
            extra_headers=headers,  # type: ignore[arg-type]
        )
    ]
    assert all(c.usage is None for c in chunks), "no usage chunk unless the client asks for it"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text

    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
    )
    chunks = [c async for c in stream]
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= (usage.prompt_tokens // BLOCK) * BLOCK - BLOCK

    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        extra_headers=headers,  # type: ignore[arg-type]
    )
    completion = raw.parse()
    assert raw.headers["x-kvgate-route"] == "session"
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens > 0
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    model = await client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "kvgate")
    for missing in ("nope", "meta-llama/Llama-3.1-8B"):  # (an id with a slash reaches the same handler)
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.retrieve(missing)
        assert caught.value.code == "model_not_found" and missing in caught.value.message
    await client.close()


async def test_legacy_completions_with_token_ids(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 2})
    prompt = list(range(1, 200))
    status, body, headers = await cluster.post(
        "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3}
    )
    assert status == 200 and body["object"] == "text_completion"
    status, body, headers2 = await cluster.post(
        "/v1/completions", {"model": MODEL, "prompt": [[*prompt, 7, 8, 9]], "max_tokens": 3}
    )
    assert status == 200 and headers2["x-kvgate-engine"] == headers["x-kvgate-engine"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompt) // BLOCK) * BLOCK


async def test_engines_that_take_packed_ids_read_the_same_prompt(make_cluster: ClusterFactory) -> None:
    # The simulated engine reports "token_ids_hex" on /health, so the gateway sends it the prompt's ids
    # packed; its answer (seeded by those ids) and usage must equal a direct request with JSON numbers.
    cluster = await make_cluster({"eu-west": 1})
    engine = cluster.gateway.fleet.engines["eu-west/e0"]
    await cluster.wait_for(lambda: engine.packed_token_ids)
    prompt = [0, 1, 2**20, 151_643, *range(300, 600)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5}
    status, through, _ = await cluster.post("/v1/completions", body)
    assert status == 200, through
    status, direct, _ = await cluster.post("/v1/completions", body, url=engine.url)
    assert status == 200, direct
    assert through["choices"][0]["text"] == direct["choices"][0]["text"]
    assert through["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"] == len(prompt)


async def test_tool_calls_go_only_to_engines_configured_for_them(make_cluster: ClusterFactory) -> None:
    recorder = Recorder()
    cluster = await make_cluster(
        {"eu-west": 2},
        extra_engines={"eu-west/tools": recorder.app},
        engine_options={"eu-west/tools": {"kv_events": False, "tools": True}},
    )
    await cluster.wait_for(lambda: all(e.healthy for e in cluster.gateway.fleet))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    body = {**chat([{"role": "user", "content": "weather in Oslo?"}], max_tokens=8), "tools": tools}
    for i in range(4):
        status, answer, headers = await cluster.post("/v1/chat/completions", {**body, "user": f"u{i}"})
        assert status == 200 and headers["x-kvgate-engine"] == "eu-west/tools", answer
    assert all(sent["tools"] == tools for sent in recorder.bodies) and len(recorder.bodies) == 4
    status, _, headers = await cluster.post(
        "/v1/chat/completions", {**body, "tools": None, "tool_choice": "none"}
    )
    assert status == 200  # no tools asked for: any engine


async def test_a_client_that_leaves_aborts_its_engine_request(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1}, sim={"decode_s_per_token": 0.05})
    assert cluster.session is not None
    sim = cluster.sim("eu-west/e0")
    body = chat([{"role": "user", "content": "long answer"}], max_tokens=1000, stream=True)
    response = await cluster.session.post(cluster.url + "/v1/chat/completions", json=body)
    await response.content.readany()
    assert sim.running == 1
    response.close()
    await cluster.wait_for(lambda: sim.running == 0)
    await cluster.wait_for(lambda: cluster.gateway.fleet.engines["eu-west/e0"].inflight == 0)


async def test_engines_without_kv_events_are_routed_by_the_gateways_own_records(
    make_cluster: ClusterFactory,
) -> None:
    opts = {f"eu-west/e{i}": {"kv_events": False} for i in range(3)}
    cluster = await make_cluster({"eu-west": 3}, engine_options=opts)
    first = chat([{"role": "system", "content": system_prompt("approx")}])
    _, _, headers = await cluster.post("/v1/chat/completions", first)
    second = chat(
        [{"role": "system", "content": system_prompt("approx")}, {"role": "user", "content": "again"}]
    )
    _, body, headers2 = await cluster.post("/v1/chat/completions", second)
    assert headers2["x-kvgate-engine"] == headers["x-kvgate-engine"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    held = await cluster.gateway.state.index.holdings(headers["x-kvgate-engine"])
    assert held.exact == frozenset() and held.approximate  # nothing exact: the engine said nothing


async def test_metrics_report_cached_tokens_and_routing(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 2})
    messages = [{"role": "system", "content": system_prompt("m")}]
    for _ in range(3):
        await cluster.post("/v1/chat/completions", chat(messages), headers={"x-session-affinity": "m"})
    assert cluster.session is not None
    async with cluster.session.post(
        cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "s", "stream": True}
    ) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        assert (await r.read()).endswith(b"data: [DONE]\n\n")
    async with cluster.session.get(cluster.url + "/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    prompt = sum(v for k, v in values.items() if k.startswith("kvgate_prompt_tokens_total"))
    cached = sum(v for k, v in values.items() if k.startswith("kvgate_cached_prompt_tokens_total"))
    assert prompt > 0 and 0.5 < cached / prompt < 1  # two of three identical prompts were cached
    assert any(k.startswith("kvgate_routing_decisions_total") and 'reason="session"' in k for k in values)
    assert values['kvgate_time_to_first_token_seconds_count{model="kvgate-sim",region="eu-west"}'] == 1
    assert values['kvgate_request_duration_seconds_count{model="kvgate-sim",region="eu-west"}'] == 4
    assert values['kvgate_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 3


async def test_unknown_model_and_no_healthy_engine(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1})
    status, body, _ = await cluster.post(
        "/v1/chat/completions", {**chat([{"role": "user", "content": "x"}]), "model": "nope"}
    )
    assert status == 404 and body["error"]["code"] == "model_not_found"
    await cluster.stop_engine("eu-west/e0")
    await cluster.wait_for(lambda: not cluster.gateway.fleet.engines["eu-west/e0"].healthy)
    status, body, headers = await cluster.post(
        "/v1/chat/completions", chat([{"role": "user", "content": "x"}])
    )
    assert status == 503 and body["error"]["code"] == "no_engine_available"
    assert headers["Retry-After"] == "1" and headers["retry-after-ms"] == "1000"


async def test_a_dead_engine_is_failed_over_before_its_health_check_notices(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster({"eu-west": 2}, health_interval_s=60)
    session = {"x-session-affinity": "failover"}
    _, _, headers = await cluster.post(
        "/v1/chat/completions", chat([{"role": "user", "content": "x"}]), headers=session
    )
    home = headers["x-kvgate-engine"]
    await cluster.stop_engine(home)
    status, body, headers = await cluster.post(
        "/v1/chat/completions", chat([{"role": "user", "content": "x"}]), headers=session
    )
    assert status == 200, body
    assert headers["x-kvgate-engine"] != home and headers["x-kvgate-route"] == "failover"


async def test_sessions_continue_through_another_gateway_sharing_redis(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: Any
) -> None:
    shared = {"redis_url": redis_url, "redis_prefix": redis_keys.prefix}
    cluster = await make_cluster({"eu-west": 3}, **shared)
    session = {"x-session-affinity": "travelling"}
    turn = [{"role": "system", "content": system_prompt("travel")}, {"role": "user", "content": "hi"}]
    _, _, headers = await cluster.post("/v1/chat/completions", chat(turn), headers=session)
    home = headers["x-kvgate-engine"]
    await cluster.gateway.state.writer.flush()
    _, url_b = await cluster.add_gateway("eu-west", **shared)
    status, body, headers = await cluster.post("/v1/chat/completions", chat(turn), headers=session, url=url_b)
    assert status == 200 and headers["x-kvgate-engine"] == home and headers["x-kvgate-route"] == "session"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "session", "cache_aware"])
async def test_every_policy_serves_requests(make_cluster: ClusterFactory, policy: str) -> None:
    cluster = await make_cluster({"eu-west": 2}, routing={"policy": policy})
    status, body, headers = await cluster.post(
        "/v1/chat/completions", chat([{"role": "user", "content": "x"}])
    )
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    assert headers["x-kvgate-engine"] in cluster.engines
    expected = {"round_robin": "round_robin", "least_load": "least_load", "session": "least_load"}.get(
        policy, "miss"
    )
    assert headers["x-kvgate-route"] == expected


async def test_a_model_tokenizer_drives_the_hashing(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cluster = await make_cluster({"eu-west": 3}, tokenizer=str(make_tokenizer_dir(tmp_path / "tok")))
    session = {"x-session-affinity": "bpe"}
    turn = [
        {"role": "system", "content": "the quick brown fox " * 40},
        {"role": "user", "content": "hello world"},
    ]
    _, body1, headers1 = await cluster.post("/v1/chat/completions", chat(turn), headers=session)
    prompt1 = body1["usage"]["prompt_tokens"]
    assert prompt1 < len(render_chat(turn).encode())  # BPE tokens, not bytes
    turn2 = [*turn, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    _, body2, headers2 = await cluster.post("/v1/chat/completions", chat(turn2), headers=session)
    assert headers2["x-kvgate-engine"] == headers1["x-kvgate-engine"]
    assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] >= (prompt1 // BLOCK) * BLOCK > 0


async def test_a_client_that_leaves_a_non_streaming_request_aborts_it(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1}, sim={"decode_s_per_token": 0.05})
    assert cluster.session is not None
    sim = cluster.sim("eu-west/e0")
    request = asyncio.create_task(
        cluster.session.post(
            cluster.url + "/v1/chat/completions",
            json=chat([{"role": "user", "content": "x"}], max_tokens=1000),
        )
    )
    await cluster.wait_for(lambda: sim.running == 1)
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request
    await cluster.wait_for(lambda: sim.running == 0)
    await cluster.wait_for(lambda: cluster.gateway.fleet.engines["eu-west/e0"].inflight == 0)
