"""What the official openai SDK sees of the gateway: the answers and errors it parses, the headers it
reads."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from gateway.tenancy.tenants import create_key
from tests.conftest import ThirdPartyFleet
from tests.harness import MODEL, Cluster, ClusterFactory
from tests.raw_http import Replies, Reply


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_an_engines_refusal_reaches_the_sdk_as_that_engines_error(
    third_party: ThirdPartyFleet, kind: str
) -> None:
    # vLLM nests its error as OpenAI does; SGLang's ErrorResponse is flat ({"object": "error", "message",
    # ...}). The client must get the engine's message and param either way, not the flat body quoted in a
    # message of the gateway's.
    cluster, _ = await third_party({"eu-west/e0": {"kind": kind, "max_model_len": 64}})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.completions.create(model="tiny", prompt=[7] * 80, max_tokens=2)
    await client.close()
    assert raised.value.body == {
        "message": "Input length (80) exceeds model's maximum context length (64).",
        "type": "BadRequestError",
        "param": "prompt",
        "code": 400,
    }
    assert raised.value.message == "Error code: 400 - " + str(raised.value.body["message"])


async def test_the_gateways_own_errors_carry_the_request_id(make_cluster: ClusterFactory) -> None:
    # The SDK reads x-request-id into every APIStatusError (exc.request_id): what a client quotes to find its
    # request in the gateway's and the engines' logs. The gateway's own refusals sent none.
    cluster = await make_cluster({"eu-west": 1})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    hello = [{"role": "user", "content": "hello"}]
    mine = {"x-request-id": "client-chosen-1"}
    with pytest.raises(openai.NotFoundError) as not_found:  # refused while preparing
        await client.chat.completions.create(model="gpt-17", messages=hello, extra_headers=mine)
    assert not_found.value.request_id == "client-chosen-1"
    with pytest.raises(openai.BadRequestError) as invalid:  # refused by validation, no id of the client's
        await client.chat.completions.create(model=MODEL, messages=hello, temperature=7)
    assert invalid.value.request_id is not None and invalid.value.request_id.startswith("req-")
    with pytest.raises(openai.BadRequestError) as another:  # each refusal gets an id of its own
        await client.completions.create(model=MODEL, prompt="hi", extra_body={"max_tokens": "a lot"})
    assert another.value.request_id not in (None, invalid.value.request_id)
    await cluster.stop_engine("eu-west/e0")  # refused after routing: the id the engine was sent
    with pytest.raises(openai.APIStatusError) as failed:
        await client.chat.completions.create(model=MODEL, messages=hello, extra_headers=mine)
    assert failed.value.status_code in (502, 503) and failed.value.request_id == "client-chosen-1"
    await client.close()


async def test_a_text_part_without_its_text_is_refused_for_what_it_lacks(
    make_cluster: ClusterFactory,
) -> None:
    # It was refused as "content part of type 'text' is not supported; only text is": the client is told the
    # type it used is unsupported, and that the same type is the one supported.
    cluster = await make_cluster({"eu-west": 1})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    for part in ({"type": "text"}, {"type": "text", "text": None}):
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": [part]}],
            )
        assert raised.value.body == {
            "message": "a content part of type 'text' needs its text, a string",
            "type": "invalid_request_error",
            "param": "messages",
            "code": None,
        }
    with pytest.raises(openai.BadRequestError) as image:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        )
    assert image.value.message.endswith("content part of type 'image_url' is not supported; only text is")
    await client.close()


async def raw_reply(cluster: Cluster, request: bytes) -> Reply:
    """The first answer to ``request`` sent on a connection of its own (the connection is then closed)."""
    host, port = cluster.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    replies = Replies()
    try:
        writer.write(request)
        async with asyncio.timeout(10):
            while not replies.done and (data := await reader.read(65536)):
                replies.feed(data)
    finally:
        writer.close()
    assert replies.done, "closed without an answer"
    return replies.done[0]


def raw_get(path: str, *headers: str) -> bytes:
    return ("\r\n".join([f"GET {path} HTTP/1.1", "Host: test", *headers]) + "\r\n\r\n").encode()


def raw_post(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json", *headers]
    if not any(h.lower().startswith("content-length") for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def test_refusals_before_any_handler_and_every_endpoints_answers_carry_the_request_id(
    make_cluster: ClusterFactory,
) -> None:
    # OpenAI sends x-request-id on every response, and the SDK reads it into every error it raises. The
    # HTTP layer's own answers (a refused key, a path or method no route takes) and the endpoints other than
    # the completions' (the models, the usage) sent none: AuthenticationError.request_id was None.
    cluster = await make_cluster(
        {"eu-west": 1},
        auth={"enabled": True, "usage_reads_per_minute": 1},
        tenants={"acme": {}},
    )
    key, _ = await create_key(cluster.gateway.billing.keys, "acme")
    mine = {"x-request-id": "client-chosen-2"}
    hello = [{"role": "user", "content": "hello"}]
    stranger = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="kvg-nobody-0000", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:  # refused before the body is read
        await stranger.chat.completions.create(model=MODEL, messages=hello, extra_headers=mine)
    assert refused.value.request_id == "client-chosen-2"
    with pytest.raises(openai.AuthenticationError) as refused_models:
        await stranger.models.list()
    assert (refused_models.value.request_id or "").startswith("req-")
    await stranger.close()
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.models.retrieve("gpt-17", extra_headers=mine)
    assert unknown.value.request_id == "client-chosen-2"
    listed = await client.models.with_raw_response.list()
    retrieved = await client.models.with_raw_response.retrieve(MODEL, extra_headers=mine)
    assert listed.request_id is not None and listed.request_id.startswith("req-")
    assert retrieved.request_id == "client-chosen-2"
    await client.close()
    auth = f"Authorization: Bearer {key}"
    missing = await raw_reply(cluster, raw_post("/v1/chat/completions", b"{}", "X-Request-Id: no-key-1"))
    assert missing.status == 401 and missing.headers["x-request-id"] == "no-key-1"
    usage = await raw_reply(cluster, raw_get("/v1/usage", auth))
    limited = await raw_reply(cluster, raw_get("/v1/usage", auth, "X-Request-Id: usage-2"))
    assert usage.status == 200 and usage.headers["x-request-id"].startswith("req-")
    assert limited.status == 429 and limited.headers["x-request-id"] == "usage-2"
    ids = {r.headers["x-request-id"] for r in (usage, missing, limited)} | {listed.request_id}
    assert len(ids) == 4  # each answer an id of its own


@pytest.mark.parametrize(
    ("request_bytes", "status", "echoed"),
    [
        (raw_get("/v2/nothing", "X-Request-Id: lost-1"), 404, "lost-1"),
        (raw_get("/v1/chat/completions", "X-Request-Id: wrong-verb"), 405, "wrong-verb"),
        (
            raw_post("/v1/chat/completions", b"", "X-Request-Id: big-1", f"Content-Length: {1 << 30}"),
            413,
            "big-1",
        ),
        (raw_post("/v1/chat/completions", b"{}", "X-Request-Id: exp-1", "Expect: coffee"), 417, "exp-1"),
        (raw_get("/health", "X-Request-Id: h-1", *[f"X-Pad-{i}: v" for i in range(200)]), 431, "h-1"),
        (raw_get("/" + "a" * 9000), 414, None),
        (b"NOT HTTP AT ALL\r\n\r\n", 400, None),
        (raw_get("/health", "X-Request-Id: two words"), 200, None),  # not a sane id: a fresh one
        (raw_get("/health", "X-Request-Id: " + "x" * 129), 200, None),
        (raw_get("/metrics", "X-Request-Id: scrape-1"), 200, "scrape-1"),
    ],
    ids=["404", "405", "413", "417", "431", "414", "400", "spaces", "too-long", "metrics"],
)
async def test_every_answer_of_the_http_layer_carries_the_request_id(
    make_cluster: ClusterFactory, request_bytes: bytes, status: int, echoed: str | None
) -> None:
    cluster = await make_cluster({"eu-west": 1})
    reply = await raw_reply(cluster, request_bytes)
    assert reply.status == status
    rid = reply.headers.get("x-request-id", "")
    assert rid == echoed if echoed is not None else rid.startswith("req-")


async def test_a_connection_refused_on_accept_carries_a_request_id_of_its_own(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster({"eu-west": 1}, edge={"max_connections": 1})
    host, port = cluster.url.removeprefix("http://").split(":")
    _, held = await asyncio.open_connection(host, int(port))
    try:
        refused = [await raw_reply(cluster, raw_get("/health")) for _ in range(2)]
    finally:
        held.close()
    assert [r.status for r in refused] == [503, 503]
    ids = [r.headers.get("x-request-id", "") for r in refused]
    assert all(rid.startswith("req-") for rid in ids) and ids[0] != ids[1]


async def test_stream_options_without_a_stream_are_refused_as_openai_and_vllm_refuse_them(
    make_cluster: ClusterFactory,
) -> None:
    # OpenAI answers 400 "The 'stream_options' parameter is only allowed when 'stream' is enabled." (param
    # stream_options), vLLM "Stream options can only be defined when `stream=True`."; through the gateway
    # to kvgate's engines the request was answered 200, its stream_options silently dropped.
    cluster = await make_cluster({"eu-west": 1})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    hello = [{"role": "user", "content": "hello"}]
    usage = {"include_usage": True}
    for stream in (None, False):
        chat = {} if stream is None else {"stream": stream}
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(
                model=MODEL, messages=hello, max_tokens=2, stream_options=usage, **chat
            )
        assert raised.value.body["param"] == "stream_options"
        assert raised.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as completion:
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream_options=usage)
    assert completion.value.body["param"] == "stream_options"
    # What both take: none, null, an empty object (vLLM refuses only a non-empty one), or with a stream.
    for options in ({}, {"stream_options": None}, {"stream_options": {}}):
        answer = await client.chat.completions.create(model=MODEL, messages=hello, max_tokens=2, **options)
        assert answer.usage is not None
    chunks = await client.chat.completions.create(
        model=MODEL, messages=hello, max_tokens=2, stream=True, stream_options=usage
    )
    assert [c.usage for c in [c async for c in chunks] if c.usage is not None]
    await client.close()


async def test_an_assistants_refusal_part_is_text_of_the_conversation(make_cluster: ClusterFactory) -> None:
    # OpenAI's assistant messages take content parts of type text or refusal ({"type": "refusal", "refusal":
    # "..."}), and vLLM renders a refusal part as its text. The gateway refused the conversation: "content
    # part of type 'refusal' is not supported; only text is".
    cluster = await make_cluster({"eu-west": 1})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    said = "I can't help with that."

    def conversation(content: Any) -> list[Any]:
        return [
            {"role": "user", "content": "pick a lock"},
            {"role": "assistant", "content": content},
            {"role": "user", "content": "why not?"},
        ]

    parts = await client.chat.completions.create(
        model=MODEL, messages=conversation([{"type": "refusal", "refusal": said}]), max_tokens=2
    )
    text = await client.chat.completions.create(model=MODEL, messages=conversation(said), max_tokens=2)
    assert parts.usage is not None and text.usage is not None
    assert parts.usage.prompt_tokens == text.usage.prompt_tokens  # the same prompt, as vLLM renders it
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(
            model=MODEL, messages=conversation([{"type": "refusal"}]), max_tokens=2
        )
    assert raised.value.body == {
        "message": "a content part of type 'refusal' needs its refusal, a string",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }
    await client.close()


async def test_a_vllm_fleet_takes_more_than_four_stop_strings_and_vllms_own_fields_untouched(
    third_party: ThirdPartyFleet,
) -> None:
    # OpenAI documents "up to 4" stop sequences, but vLLM takes any number (evaluation harnesses send more)
    # and kvgate's engines refuse a fifth themselves (400, param stop): the gateway refused what the engine
    # behind it takes. vLLM's sampling and template fields reach it as the client sent them.
    cluster, engines = await third_party({"eu-west/v": {"kind": "vllm"}})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    stops = ["\n\n", "Q:", "</s>", "###", "User:", "Question:"]
    extras = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "chat_template_kwargs": {"x": 1},
              "guided_json": {"type": "object"}, "stop_token_ids": [2]}  # fmt: skip
    answer = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        stop=stops,
        extra_body=extras,
    )
    text = await client.completions.create(model="tiny", prompt="hello", max_tokens=2, stop=stops)
    await client.close()
    assert answer.choices and text.choices
    [chat_body] = engines["eu-west/v"].bodies("/v1/chat/completions")
    [completion_body] = engines["eu-west/v"].bodies("/v1/completions")
    assert chat_body["stop"] == stops and completion_body["stop"] == stops
    assert {k: chat_body[k] for k in extras} == extras


async def test_a_content_part_given_as_a_plain_string_is_text_as_vllm_reads_it(
    make_cluster: ClusterFactory,
) -> None:
    # vLLM takes a string among a message's content parts as a text part (its chat_utils); the gateway's
    # schema refused the request (400 "content: must be a string, null, or an array of content parts").
    cluster = await make_cluster({"eu-west": 1})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    strings = [{"role": "user", "content": ["tell me", "a story"]}]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "tell me"}, {"type": "text", "text": "a story"}],
        }
    ]
    a = await client.chat.completions.create(model=MODEL, messages=strings, max_tokens=2)  # type: ignore[arg-type]
    b = await client.chat.completions.create(model=MODEL, messages=parts, max_tokens=2)  # type: ignore[arg-type]
    assert a.usage is not None and b.usage is not None and a.usage.prompt_tokens == b.usage.prompt_tokens
    await client.close()
