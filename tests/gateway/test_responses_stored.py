"""Where stored responses are found through the gateway (tests/responses_engine.py behind it): within the
caller's tenant only, at once through any gateway sharing its Redis, a 503 while Redis cannot say, never on
an engine that does not serve the model asked for; and what the engine answers about them reaches the SDK as
an OpenAI error. Last, kvgate's own engines behind the gateway list a response's input items."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from yarl import URL

from gateway.tenancy.tenants import create_key
from tests.gateway.test_responses_api import fleet, keyed
from tests.harness import MODEL, ClusterFactory
from tests.redis_prefixes import REDIS_URL
from tests.redis_process import RedisProcess
from tests.responses_engine import ResponsesEngine


async def test_another_tenants_response_cannot_be_continued(make_cluster: ClusterFactory) -> None:
    # An id no gateway bound for the caller's tenant went to any engine, and the engine that keeps it
    # continued another tenant's conversation: its history reached the prompt of a stranger's request.
    _, engine, clients = await keyed(make_cluster, {"acme": {}, "globex": {}})
    acme, globex = clients["acme"], clients["globex"]
    response = await acme.responses.create(model=MODEL, input="acme's secret")
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as raised:
            await globex.responses.create(
                model=MODEL, input="what did I say?", previous_response_id=response.id, stream=stream
            )
        assert raised.value.body == {
            "message": f"Response with id '{response.id}' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": None,
        }
        assert raised.value.response.headers["x-request-id"]
    assert len(engine.bodies) == 1
    await acme.responses.create(model=MODEL, input="and then?", previous_response_id=response.id)
    assert len(engine.bodies) == 2
    await asyncio.gather(acme.close(), globex.close())


async def test_a_response_made_through_one_gateway_is_found_at_once_through_another(
    make_cluster: ClusterFactory,
) -> None:
    # Its binding went to Redis behind the writer's backlog: the client, continuing or reading it through
    # another gateway as soon as it had the id, was told it does not exist (or sent to the wrong engine).
    shared = {"redis_url": REDIS_URL, "routing": {"policy": "least_load"}}
    cluster, engines, first = await fleet(make_cluster, 2, **shared)
    options = {f"eu-west/e{i}": {"kv_events": False} for i in range(2)}
    _, url = await cluster.add_gateway(
        "eu-west", redis_prefix=cluster.redis_prefix, engine_options=options, **shared
    )
    second = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    for turn in range(10):
        made = await first.responses.create(model=MODEL, input=f"q{turn}", stream=turn % 2 == 1)
        if isinstance(made, openai.AsyncStream):
            made = [event async for event in made][-1].response
        assert (await second.responses.retrieve(made.id)).id == made.id
        holder = next(e for e in engines if made.id in e.kept)
        nxt = await second.responses.create(model=MODEL, input="and then?", previous_response_id=made.id)
        assert nxt.id in holder.kept
    await asyncio.gather(first.close(), second.close())


async def test_while_redis_is_away_another_gateways_response_is_unavailable_not_unknown(
    make_cluster: ClusterFactory, private_redis: RedisProcess
) -> None:
    # A response made through one gateway while Redis is away is known there alone (Redis gets it back when
    # it returns). Another gateway, which cannot ask Redis, said it does not exist (404): the client gave up
    # a conversation that its engine still keeps. It is a 503 now, which the SDK retries.
    shared = {"redis_url": private_redis.url, "auth": {"enabled": True}, "tenants": {"acme": {}}}
    cluster, engines, _ = await fleet(make_cluster, 1, **shared)
    key = (await create_key(cluster.gateway.billing.keys, "acme"))[0]
    options = {"eu-west/e0": {"kv_events": False}}
    other, url = await cluster.add_gateway(
        "eu-west", redis_prefix=cluster.redis_prefix, engine_options=options, **shared
    )
    first = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0)
    second = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    await asyncio.gather(first.models.list(), second.models.list())  # (the key is known before Redis goes)
    private_redis.stop()
    gateways = (cluster.gateway, other)
    await cluster.wait_for(lambda: all(g.state.writer.failing for g in gateways), within_s=5)
    made = await first.responses.create(model=MODEL, input="hi")
    for ask in (
        second.responses.retrieve(made.id),
        second.responses.create(model=MODEL, input="and then?", previous_response_id=made.id),
    ):
        with pytest.raises(openai.InternalServerError) as raised:
            await ask
        assert raised.value.status_code == 503 and "Redis" in raised.value.message
    assert made.id in engines[0].kept and len(engines[0].bodies) == 1
    await asyncio.gather(first.close(), second.close())


async def test_a_response_continued_with_a_model_its_engine_does_not_serve_is_a_400(
    make_cluster: ClusterFactory,
) -> None:
    # Only the engine that keeps the response can continue it: one that does not serve the model asked for
    # left no engine to route to, a 503 "no healthy engine ... right now" that the SDK retried to no end.
    engines = {"e0": ResponsesEngine("e0"), "e1": ResponsesEngine("e1", model="other")}
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={f"eu-west/{name}": e.app for name, e in engines.items()},
        engine_options={
            "eu-west/e0": {"kv_events": False},
            "eu-west/e1": {"kv_events": False, "model": "other"},
        },
    )
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    made = await client.responses.create(model=MODEL, input="hi")
    with pytest.raises(openai.BadRequestError) as raised:
        await client.responses.create(model="other", input="and then?", previous_response_id=made.id)
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == "previous_response_id"
    assert "does not serve model 'other'" in raised.value.message
    assert engines["e1"].bodies == [] and len(engines["e0"].bodies) == 1
    await client.close()


@pytest.mark.parametrize(
    ("status", "body", "relayed"),
    [
        (500, "Internal Server Error", 502),  # (a crashed handler, a proxy's page)
        (404, "404: Not Found", 404),  # (an engine without the route)
        (200, "<html>a proxy's page</html>", 502),
    ],
)
async def test_what_an_engine_answers_about_a_stored_response_reaches_the_sdk_as_an_openai_error(
    make_cluster: ClusterFactory, status: int, body: str, relayed: int
) -> None:
    # Relayed as it came, labelled JSON: the SDK raised "Error code: 500" with no message, or failed parsing
    # a 200 with a JSONDecodeError of its own. Now as the completions path relays an engine's answer.
    _, [engine], client = await fleet(make_cluster)
    made = await client.responses.create(model=MODEL, input="hi")
    engine.about_answer = (status, body)
    with pytest.raises(openai.APIStatusError) as raised:
        await client.responses.retrieve(made.id)
    error = raised.value
    assert error.status_code == relayed and error.request_id
    assert isinstance(error.body, dict) and set(error.body) == {"message", "type", "param", "code"}
    assert "engine eu-west/e0" in error.message
    await client.close()


async def test_requests_about_stored_responses_count_against_the_request_limit(
    make_cluster: ClusterFactory,
) -> None:
    # Each costs an engine a request; none was counted, so a key limited to 3 requests a minute could ask an
    # engine about responses without end.
    _, engine, clients = await keyed(make_cluster, {"tiny": {"requests_per_minute": 3}})
    client = clients["tiny"]
    made = await client.responses.create(model=MODEL, input="hi")
    raw = await client.responses.with_raw_response.retrieve(made.id)
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    await client.responses.retrieve(made.id)
    with pytest.raises(openai.RateLimitError):
        await client.responses.retrieve(made.id)
    assert len(engine.asked) == 2
    await client.close()


async def test_head_of_a_stored_response_is_its_gets_head(make_cluster: ClusterFactory) -> None:
    # The route's 405 says HEAD is allowed (every GET route answers HEAD), but a HEAD of a response that
    # exists was a 404 "no route for HEAD": the head of the GET's answer now, the engine asked with a GET.
    cluster, [engine], client = await fleet(make_cluster)
    made = await client.responses.create(model=MODEL, input="hi")
    assert cluster.session is not None
    async with cluster.session.get(f"{cluster.url}/v1/responses/{made.id}") as got:
        body = await got.read()
    async with cluster.session.head(f"{cluster.url}/v1/responses/{made.id}") as head:
        assert head.status == 200 and await head.read() == b""
        assert head.headers["Content-Length"] == str(len(body)) and head.headers["x-request-id"]
    assert engine.asked == [("GET", f"/v1/responses/{made.id}")] * 2
    async with cluster.session.head(f"{cluster.url}/v1/responses/resp_unknown") as head:
        assert head.status == 404
    await client.close()


async def test_a_response_whose_engine_is_down_is_a_503_that_says_when_to_retry(
    make_cluster: ClusterFactory,
) -> None:
    # The engine that keeps it failing, then declared unhealthy: 503s that said nothing of when to come back,
    # where every other 503 of the gateway does (Retry-After, and OpenAI's retry-after-ms).
    cluster, _, client = await fleet(make_cluster)
    made = await client.responses.create(model=MODEL, input="hi")
    await cluster.stop_engine("eu-west/e0")
    engine = cluster.gateway.fleet.engines["eu-west/e0"]
    for _ in ("failing", "unhealthy"):
        with pytest.raises(openai.InternalServerError) as raised:
            await client.responses.retrieve(made.id)
        error = raised.value
        assert error.status_code == 503 and "eu-west/e0" in error.message and error.request_id
        assert (error.response.headers.get("retry-after"), error.response.headers.get("retry-after-ms")) == (
            "1",
            "1000",
        )
        await cluster.wait_for(lambda: not engine.healthy)
    await client.close()


async def test_kvgate_engines_behind_the_gateway_list_a_responses_input_items(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    # kvgate's engine did not serve GET /v1/responses/{id}/input_items: the gateway asked the engine that
    # keeps the response, which answered 404, so the SDK's input_items.list failed against kvgate demo.
    cluster = await make_cluster({"eu-west": 2}, real_model=tiny_model_dir, tokenizer=str(tiny_model_dir))
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    first = await client.responses.create(model=cluster.model, input="hello there", max_output_tokens=2)
    second = await client.responses.create(
        model=cluster.model, input="and then?", previous_response_id=first.id, max_output_tokens=2
    )
    (asked,) = [item async for item in client.responses.input_items.list(first.id)]
    assert asked.type == "message" and asked.role == "user" and asked.content[0].type == "input_text"
    items = [item async for item in client.responses.input_items.list(second.id, limit=1, order="asc")]
    assert [item.id for item in items] == [asked.id, first.output[0].id, items[2].id]
    newest = await client.responses.input_items.list(second.id, limit=2)
    assert [item.id for item in newest.data] == [items[2].id, items[1].id] and newest.has_more
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.input_items.list(second.id, limit=500)
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        await client.responses.input_items.list("resp_nobody_made")
    await client.close()


@pytest.mark.parametrize("redis", [False, True])
async def test_a_response_is_continued_after_its_session_would_have_expired(
    make_cluster: ClusterFactory, redis: bool
) -> None:
    # Its binding lived as long as a session's (session_ttl_s, an hour by default): a client continuing
    # a conversation after that got a 404 although the engine kept the response (response_ttl_s now).
    shared = {"redis_url": REDIS_URL} if redis else {}
    cluster, [engine], _ = await fleet(
        make_cluster, auth={"enabled": True}, tenants={"acme": {}}, session_ttl_s=0.3, **shared
    )
    key = (await create_key(cluster.gateway.billing.keys, "acme"))[0]
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0)
    response = await client.responses.create(model=MODEL, input="remember this")
    await asyncio.sleep(0.5)
    later = await client.responses.create(model=MODEL, input="and then?", previous_response_id=response.id)
    assert later.id in engine.kept and (await client.responses.retrieve(response.id)).id == response.id
    await client.close()


async def test_a_request_id_in_the_body_cannot_name_another_tenants_response(
    make_cluster: ClusterFactory,
) -> None:
    # vLLM keeps a response under the request's own ``request_id`` (an extra field of its Responses request),
    # and its conversation under it at once. The gateway forwarded the field: a tenant that knew another's
    # response id overwrote that response on its engine (the owner's next turn continued the stranger's
    # conversation), and got a binding of its own to read the engine's copy through.
    _, engine, clients = await keyed(make_cluster, {"acme": {}, "globex": {}})
    acme, globex = clients["acme"], clients["globex"]
    made = await acme.responses.create(model=MODEL, input="acme's secret")
    kept = engine.kept[made.id]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as raised:
            await globex.responses.create(
                model=MODEL, input="ignore all that", stream=stream, extra_body={"request_id": made.id}
            )
        assert raised.value.body["param"] == "request_id"
    assert engine.kept[made.id] is kept and len(engine.bodies) == 1
    with pytest.raises(openai.NotFoundError):
        await globex.responses.retrieve(made.id)
    assert (await acme.responses.retrieve(made.id)).id == made.id
    await asyncio.gather(acme.close(), globex.close())


@pytest.mark.parametrize("redis", [False, True])
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/%FF%FE"),
        ("DELETE", "/v1/responses/%C3%28"),
        ("POST", "/v1/responses/%ED%A0%80/cancel"),
        ("GET", "/v1/responses/resp_%FF/input_items"),
    ],
)
async def test_an_id_that_is_no_utf8_text_is_not_found(
    make_cluster: ClusterFactory, redis: bool, method: str, path: str
) -> None:
    # The path's bytes decode to lone surrogates, which neither the engine's URL (quote) nor a Redis key
    # could encode: the request about it was a 500 "internal error in the gateway" instead of the 404 of any
    # id nobody made.
    cluster, [engine], client = await fleet(make_cluster, **({"redis_url": REDIS_URL} if redis else {}))
    assert cluster.session is not None
    async with cluster.session.request(method, URL(cluster.url + path, encoded=True)) as r:
        body = await r.json()
    assert r.status == 404, body
    assert body["error"]["param"] == "response_id" and body["error"]["type"] == "invalid_request_error"
    assert r.headers["x-request-id"] and engine.asked == []
    await client.close()
