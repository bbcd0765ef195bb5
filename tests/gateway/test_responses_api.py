"""The gateway's Responses API (``/v1/responses``) with the OpenAI SDK, in front of simulated Responses
engines (tests/responses_engine.py, which keep responses as vLLM does with its store on): answers relayed
whole and streamed, billed by their usage; a continued response goes to the engine that keeps it; requests
about a stored response are asked of that engine, within the caller's tenant."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.tenancy.billing import usage_counts
from gateway.tenancy.tenants import create_key
from tests.gateway.test_trace_context import PARENT as TRACEPARENT
from tests.harness import MODEL, Cluster, ClusterFactory
from tests.responses_engine import USAGE, ResponsesEngine, sse_event

PRICES = {MODEL: {"input": 1, "cached_input": 0.1, "output": 2}}


async def fleet(
    make_cluster: ClusterFactory, count: int = 1, **gateway: Any
) -> tuple[Cluster, list[ResponsesEngine], openai.AsyncOpenAI]:
    engines = [ResponsesEngine(f"e{i}") for i in range(count)]
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={f"eu-west/e{i}": e.app for i, e in enumerate(engines)},
        engine_options={f"eu-west/e{i}": {"kv_events": False} for i in range(count)},
        prices=PRICES,
        **gateway,
    )
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    return cluster, engines, client


async def keyed(
    make_cluster: ClusterFactory, tenants: dict[str, dict[str, Any]]
) -> tuple[Cluster, ResponsesEngine, dict[str, openai.AsyncOpenAI]]:
    """One simulated Responses engine, authentication on, and a client per tenant (name: its limits), each
    with a key of its own."""
    cluster, [engine], _ = await fleet(make_cluster, auth={"enabled": True}, tenants=tenants)
    clients = {}
    for tenant in tenants:
        key = (await create_key(cluster.gateway.billing.keys, tenant))[0]
        clients[tenant] = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0)
    return cluster, engine, clients


async def records(cluster: Cluster, count: int) -> list[Any]:
    ledger = cluster.gateway.billing.ledger
    await cluster.wait_for(lambda: len(ledger._records) >= count)
    return list(await ledger.records())


async def test_a_response_is_relayed_and_billed_by_its_usage(make_cluster: ClusterFactory) -> None:
    cluster, [engine], client = await fleet(make_cluster)
    response = await client.responses.create(model=MODEL, input="Say hello", max_output_tokens=8)
    assert response.output_text == "Hello!" and response.usage is not None
    assert response.usage.input_tokens == 40 and response.usage.input_tokens_details.cached_tokens == 32
    assert response.usage.model_extra is not None and response.usage.model_extra["cost"] > 0
    [record] = await records(cluster, 1)
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == usage_counts(USAGE)
    assert record.status == "completed" and not record.estimated
    assert engine.bodies[0]["input"] == "Say hello" and "stream_options" not in engine.bodies[0]
    await client.close()


async def test_a_streamed_response_reaches_the_sdk_event_by_event_and_is_billed(
    make_cluster: ClusterFactory,
) -> None:
    cluster, _, client = await fleet(make_cluster)
    kinds, text = [], ""
    async for event in await client.responses.create(model=MODEL, input="Say hello", stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            assert event.response.usage is not None and event.response.usage.input_tokens == 40
            assert event.response.usage.model_extra is not None and "cost" in event.response.usage.model_extra
    assert text == "Hello!" and kinds[0] == "response.created" and kinds[-1] == "response.completed"
    [record] = await records(cluster, 1)
    assert (record.status, record.estimated, record.completion_tokens) == ("completed", False, 3)
    await client.close()


async def test_a_stream_that_ends_without_its_terminal_event_is_an_error_to_the_sdk(
    make_cluster: ClusterFactory,
) -> None:
    # A Responses stream has no [DONE]: a stream cut after its deltas passed for a whole answer, as the SDK
    # ends a stream quietly at its end.
    cluster, [engine], client = await fleet(make_cluster)
    created = {"id": "resp_cut", "object": "response", "status": "in_progress", "store": True, "usage": None}
    engine.script = [sse_event("response.created", 0, response=created)] + [
        sse_event(
            "response.output_text.delta", 1 + i, item_id="m", output_index=0, content_index=0, delta="x"
        )
        for i in range(2)
    ]
    text = ""
    with pytest.raises(openai.APIError, match=r"without a response\.completed event"):
        async for event in await client.responses.create(model=MODEL, input="hi", stream=True):
            text += getattr(event, "delta", "")
    assert text == "xx"
    [record] = await records(cluster, 1)
    assert (record.status, record.estimated, record.completion_tokens) == ("failed", True, 2)
    await client.close()


async def test_what_an_engine_sends_after_its_terminal_event_is_not_relayed(
    make_cluster: ClusterFactory,
) -> None:
    cluster, [engine], client = await fleet(make_cluster)
    done = {"id": "resp_x", "object": "response", "status": "completed", "store": True, "usage": USAGE}
    engine.script = [
        sse_event("response.created", 0, response={**done, "status": "in_progress", "usage": None}),
        sse_event("response.completed", 1, response=done)
        + sse_event("error", 2, code="late", message="late"),
    ]
    kinds = [
        event.type async for event in await client.responses.create(model=MODEL, input="hi", stream=True)
    ]
    assert kinds == ["response.created", "response.completed"]
    [record] = await records(cluster, 1)
    assert record.status == "completed"
    await client.close()


async def test_a_continued_response_goes_to_the_engine_that_keeps_it(make_cluster: ClusterFactory) -> None:
    # Only the engine that answered keeps the response: on any other, previous_response_id is a 404. Least
    # load alone spreads the turns over both engines.
    _, engines, client = await fleet(make_cluster, 2, routing={"policy": "least_load"})
    first = await client.responses.create(model=MODEL, input="turn 0")
    holder = next(e for e in engines if first.id in e.kept)
    previous = first.id
    for turn in range(1, 7):
        raw = await client.responses.with_raw_response.create(
            model=MODEL, input=f"turn {turn}", previous_response_id=previous
        )
        # Said as what it is: it was "miss" (a continuation's prompt is not hashed, so nothing is predicted).
        assert raw.headers["x-kvgate-route"] == "stored_response"
        nxt = raw.parse()
        assert nxt.id in holder.kept
        previous = nxt.id
    stream = await client.responses.create(
        model=MODEL, input="last", previous_response_id=previous, stream=True
    )
    async for event in stream:
        if event.type == "response.completed":
            assert event.response.id in holder.kept
    assert next(e for e in engines if e is not holder).bodies == []
    await client.close()


async def test_stored_responses_are_asked_of_their_engine(make_cluster: ClusterFactory) -> None:
    _, engines, client = await fleet(make_cluster, 2)
    made = [await client.responses.create(model=MODEL, input=f"q{i}") for i in range(4)]
    for response in made:
        holder = next(e for e in engines if response.id in e.kept)
        got = await client.responses.retrieve(response.id, extra_headers={"traceparent": TRACEPARENT})
        assert got.id == response.id and got.output_text == "Hello!"
        assert holder.asked[-1] == ("GET", f"/v1/responses/{response.id}")
        assert holder.traced[-1] == TRACEPARENT  # (the client's trace goes on in the engine)
        # (stream=0 is as false as stream=false: it was refused as a request to stream.)
        again = await client.get(
            f"/responses/{response.id}", options={"params": {"stream": "0"}}, cast_to=object
        )
        assert isinstance(again, dict) and again["id"] == response.id
        items = await client.responses.input_items.list(response.id, limit=5)
        assert items.data == [] and holder.asked[-1] == (
            "GET",
            f"/v1/responses/{response.id}/input_items?limit=5",
        )
        await client.responses.delete(response.id)
        assert response.id not in holder.kept
    with pytest.raises(openai.NotFoundError) as raised:
        await client.responses.retrieve("resp_nobody_made")
    assert raised.value.body == {
        "message": "Response with id 'resp_nobody_made' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": None,
    }
    await client.close()


async def test_a_response_not_stored_is_not_bound(make_cluster: ClusterFactory) -> None:
    _, [engine], client = await fleet(make_cluster)
    response = await client.responses.create(model=MODEL, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    assert engine.asked == []  # (the gateway knew it holds nothing)
    await client.close()


async def test_another_tenants_response_is_not_found(make_cluster: ClusterFactory) -> None:
    cluster, engine, clients = await keyed(make_cluster, {"acme": {}, "globex": {}})
    acme, globex = clients["acme"], clients["globex"]
    response = await acme.responses.create(model=MODEL, input="acme's secret")
    assert (await acme.responses.retrieve(response.id)).id == response.id
    for ask in (globex.responses.retrieve(response.id), globex.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError):
            await ask
    assert response.id in engine.kept
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(
            base_url=cluster.url + "/v1", api_key="sk-wrong", max_retries=0
        ).responses.retrieve(response.id)
    await asyncio.gather(acme.close(), globex.close())


async def test_the_history_a_continued_response_read_counts_against_the_token_limit(
    make_cluster: ClusterFactory,
) -> None:
    # Admission counts a continued response's new input alone (the history is on its engine). The engine's
    # usage then said 1990 input tokens, but only an overrun of output tokens was charged afterwards: turn
    # after turn, a conversation's whole history went past tokens_per_minute uncounted.
    cluster, engine, clients = await keyed(make_cluster, {"small": {"tokens_per_minute": 2000}})
    client = clients["small"]
    first = await client.responses.create(model=MODEL, input="hi", max_output_tokens=8)
    engine.usage = {**USAGE, "input_tokens": 1990, "total_tokens": 1993}
    await client.responses.create(
        model=MODEL, input="and then?", previous_response_id=first.id, max_output_tokens=8
    )
    await records(cluster, 2)
    with pytest.raises(openai.RateLimitError):
        await client.responses.create(model=MODEL, input="hi", max_output_tokens=8)
    await client.close()


async def test_a_responses_request_is_one_answer_whatever_n_it_names(make_cluster: ClusterFactory) -> None:
    # The Responses API has no n (vLLM's ignores it): admission charged n answers' budgets all the same.
    _, engine, clients = await keyed(make_cluster, {"small": {"tokens_per_minute": 1000}})
    client = clients["small"]
    await client.responses.create(model=MODEL, input="hi", max_output_tokens=16, extra_body={"n": 100})
    assert engine.bodies[0]["n"] == 100  # (forwarded, as unknown fields are)
    await client.close()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 5}, "input"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "previous_response_id": ""}, "previous_response_id"),
        ({}, "input"),
        ({"input": "hi", "metadata": "a"}, "metadata"),  # (OpenAI's and vLLM's: a map of strings)
        ({"input": "hi", "metadata": {"k": ["v"]}}, "metadata.k"),
    ],
)
async def test_requests_of_the_wrong_shape_are_refused_naming_the_field(
    make_cluster: ClusterFactory, body: dict[str, Any], param: str
) -> None:
    _, [engine], client = await fleet(make_cluster)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.post("/responses", body={"model": MODEL, **body}, cast_to=object)
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == param
    assert engine.bodies == []
    await client.close()


async def test_a_continued_response_whose_engine_is_down_is_refused_not_sent_elsewhere(
    make_cluster: ClusterFactory,
) -> None:
    cluster, engines, client = await fleet(make_cluster, 2)
    first = await client.responses.create(model=MODEL, input="turn 0")
    holder_id = next(f"eu-west/{e.name}" for e in engines if first.id in e.kept)
    await cluster.engine_runners[holder_id].cleanup()  # (the engine is gone; its health check says so)
    await cluster.wait_for(lambda: not cluster.gateway.fleet.engines[holder_id].healthy)
    with pytest.raises(openai.InternalServerError) as raised:
        await client.responses.create(model=MODEL, input="turn 1", previous_response_id=first.id)
    assert raised.value.status_code == 503 and f"kept by engine {holder_id}" in raised.value.message
    assert sum(len(e.bodies) for e in engines) == 1
    with pytest.raises(openai.InternalServerError, match="unavailable"):
        await client.responses.retrieve(first.id)
    await client.close()


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/responses/resp_1/unknown", 404),
        ("GET", "/v1/responses/" + "r" * 5000, 404),
        ("GET", "/v1/responses/..%2F..%2Fv1%2Fkv%2Fprefill", 404),
        ("POST", "/v1/responses/resp_1", 404),
        ("DELETE", "/v1/responses/resp_1/cancel", 404),
        ("PUT", "/v1/responses/resp_1", 405),
        ("GET", "/v1/responses/resp_1?stream=true", 400),
        ("GET", "/v1/responses/resp_1?stream=1", 400),
    ],
)
async def test_requests_about_stored_responses_that_name_nothing_known_get_openai_errors(
    make_cluster: ClusterFactory, method: str, path: str, status: int
) -> None:
    cluster, [engine], client = await fleet(make_cluster)
    made = await client.responses.create(model=MODEL, input="hi")
    assert cluster.session is not None
    async with cluster.session.request(method, cluster.url + path.replace("resp_1", made.id)) as r:
        body = await r.json()
        assert r.status == status and set(body["error"]) == {"message", "type", "param", "code"}
        assert r.headers["x-request-id"]
    assert engine.asked == []
    await client.close()


async def test_kvgate_engines_behind_the_gateway_continue_and_predict_responses(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    # Two of kvgate's own engines (the tiny model): a conversation by previous_response_id stays on the
    # engine that keeps it and finds its earlier turns cached there; a stateless resend of a long prompt is
    # predicted as cached exactly as the engine reports it.
    cluster = await make_cluster(
        {"eu-west": 2},
        real_model=tiny_model_dir,
        tokenizer=str(tiny_model_dir),
    )
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    model = cluster.model
    # (No instructions: vLLM leaves a response's instructions out of the next turn's prompt, whose blocks then
    # differ from the first; kvgate's engine does the same.)
    first = await client.responses.with_raw_response.create(
        model=model, input="tell me about the weather in Paris today " * 8, max_output_tokens=4
    )
    holder, previous = first.headers["x-kvgate-engine"], first.parse().id
    for turn in range(3):
        raw = await client.responses.with_raw_response.create(
            model=model, input=f"and then {turn}?", previous_response_id=previous, max_output_tokens=4
        )
        answer = raw.parse()
        assert raw.headers["x-kvgate-engine"] == holder and answer.usage is not None
        assert answer.usage.input_tokens_details.cached_tokens > 0
        previous = answer.id
    assert (await client.responses.retrieve(previous)).id == previous
    long_instructions = "You answer questions about the weather, briefly. " * 30
    for turn in range(2):
        await asyncio.sleep(0.3)  # (the engine's KV events reach the gateway)
        raw = await client.responses.with_raw_response.create(
            model=model, instructions=long_instructions, input=f"question {turn}", max_output_tokens=2
        )
        usage = raw.parse().usage
        assert usage is not None
        assert (
            int(raw.headers["x-kvgate-predicted-cached-tokens"]) == usage.input_tokens_details.cached_tokens
        )
        assert (usage.input_tokens_details.cached_tokens > 0) == (turn == 1)
    await client.close()
