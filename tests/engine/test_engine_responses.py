"""kvgate's engine serving the OpenAI Responses API, as the official openai SDK sees it: ``kvgate engine``
on a tiny random model, asked as vLLM 0.32 is asked (``client.responses.create`` / ``.stream``,
continuations by ``previous_response_id``, retrieve, delete, cancel), and what it refuses."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import ResponseInputParam

from tests.engine_process import engine_process as serving_engine

MAX_MODEL_LEN = 256
# Random weights may end an answer at once: with ignore_eos (a vLLM extension) every answer fills its budget.
FILL: dict[str, Any] = {"ignore_eos": True}


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    """``kvgate engine`` in a process of its own, until the module's tests are done."""
    with engine_process(tiny_model_dir) as url:
        yield url


def engine_process(tiny_model_dir: Path) -> contextlib.AbstractContextManager[str]:
    """``kvgate engine`` on the tiny model in a process of its own, on a free port: its URL."""
    return serving_engine(tiny_model_dir, kv_blocks=256, max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def client(engine_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=engine_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def error_body(exc: openai.APIStatusError) -> dict[str, Any]:
    assert isinstance(exc.body, dict)
    return exc.body


def test_create_answers_a_response_object_as_vllm_does(client: openai.OpenAI, model: str) -> None:
    raw = client.responses.with_raw_response.create(
        model=model,
        input="hello there",
        max_output_tokens=5,
        temperature=0,
        metadata={"k": "v"},
        extra_body=FILL,
    )
    body = raw.http_response.json()
    response = raw.parse()
    assert response.id.startswith("resp_") and response.object == "response" and response.model == model
    assert response.status == "incomplete"  # 5 tokens, no EOS: the budget cut it
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    (part,) = item.content
    assert part.type == "output_text" and part.text == response.output_text and part.text
    assert body["output"][0]["content"][0] == {
        "type": "output_text",
        "text": part.text,
        "annotations": [],
        "logprobs": None,
    }
    usage = response.usage
    assert usage is not None and usage.output_tokens == 5 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert body["usage"]["input_tokens_details"]["cached_tokens"] >= 0
    # The request's fields, echoed with the values the generation used.
    assert (body["temperature"], body["top_p"], body["max_output_tokens"]) == (0.0, 1.0, 5)
    assert (body["instructions"], body["previous_response_id"], body["metadata"]) == (None, None, {"k": "v"})
    assert (body["tool_choice"], body["tools"], body["truncation"], body["store"]) == (
        "auto",
        [],
        "disabled",
        True,
    )
    assert body["error"] is None and body["top_logprobs"] is None and isinstance(body["created_at"], int)


def test_without_a_budget_an_answer_may_fill_the_context(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input="fill it", extra_body=FILL)
    assert response.usage is not None and response.max_output_tokens is not None
    assert response.status == "incomplete"
    assert (
        response.usage.total_tokens
        == MAX_MODEL_LEN
        == response.max_output_tokens + response.usage.input_tokens
    )


def test_a_stream_sends_vllms_events_in_order(client: openai.OpenAI, model: str) -> None:
    events = list(
        client.responses.create(
            model=model, input="stream me", max_output_tokens=6, stream=True, extra_body=FILL
        )
    )
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-4]
    assert done.type == "response.output_text.done" and done.text == text
    created, completed = events[0], events[-1]
    assert created.type == "response.created" and completed.type == "response.completed"
    assert created.response.status == "in_progress" and created.response.usage is None
    final = completed.response
    assert final.id == created.response.id and final.output_text == text and final.status == "incomplete"
    assert final.usage is not None and final.usage.output_tokens == 6
    added, item_done = events[2], events[-2]
    assert added.type == "response.output_item.added" and item_done.type == "response.output_item.done"
    assert added.item.id == item_done.item.id == final.output[0].id


def test_the_sdks_stream_helper_reads_the_stream(client: openai.OpenAI, model: str) -> None:
    with client.responses.stream(
        model=model, input="help me", max_output_tokens=4, extra_body=FILL
    ) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text and final.usage is not None and final.usage.output_tokens == 4


def test_a_stream_is_server_sent_events_without_done(engine_url: str, model: str) -> None:
    body = {"model": model, "input": "raw", "max_output_tokens": 2, "stream": True, **FILL}
    post = urllib.request.Request(engine_url + "/v1/responses", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(post, timeout=30) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        text = answer.read().decode()
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and "[DONE]" not in text
    for block in blocks[:-1]:
        event, data = block.split("\n")
        assert event.startswith("event: response.") and data.startswith("data: {")
        assert f'"type":"{event.removeprefix("event: ")}"' in data


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI, model: str) -> None:
    """As vLLM: the stored conversation and output come before the new input, the instructions are the
    new request's only; the first turn's prompt is in the prefix cache."""
    first = client.responses.create(
        model=model, input="tell me a story", instructions="be brief", max_output_tokens=6, extra_body=FILL
    )
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input="and then?",
        instructions="be brief",
        max_output_tokens=3,
        extra_body=FILL,
    )
    assert second.previous_response_id == first.id
    history: ResponseInputParam = [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and then?"},
    ]
    whole = client.responses.create(
        model=model,
        input=history,
        instructions="be brief",
        max_output_tokens=1,
        store=False,
    )
    assert first.usage is not None and second.usage is not None and whole.usage is not None
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens // 2
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4  # all full blocks
    # Instructions do not carry over: without them, the continuation is the history alone.
    bare = client.responses.create(
        model=model, previous_response_id=first.id, input="and then?", max_output_tokens=1
    )
    alone = client.responses.create(model=model, input=history, max_output_tokens=1, store=False)
    assert bare.usage is not None and alone.usage is not None
    assert bare.usage.input_tokens == alone.usage.input_tokens < second.usage.input_tokens
    # A continuation of a continuation holds both turns.
    third = client.responses.create(
        model=model, previous_response_id=second.id, input="end", max_output_tokens=1
    )
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens


def test_stored_responses_are_retrieved_and_deleted(client: openai.OpenAI, model: str) -> None:
    made = client.responses.create(model=model, input="keep me", max_output_tokens=2)
    assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    assert client.delete(f"/responses/{made.id}", cast_to=object) == {
        "id": made.id,
        "object": "response",
        "deleted": True,
    }
    for gone in (lambda: client.responses.retrieve(made.id), lambda: client.responses.delete(made.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    unstored = client.responses.create(model=model, input="forget me", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id=unstored.id)


def test_an_unknown_id_is_vllms_404(client: openai.OpenAI, model: str) -> None:
    expected = {
        "message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": None,
    }
    calls: list[Callable[[], object]] = [
        lambda: client.responses.retrieve("resp_nope"),
        lambda: client.responses.cancel("resp_nope"),
        lambda: client.responses.create(model=model, input="x", previous_response_id="resp_nope"),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert error_body(missing.value) == expected


def test_cancelling_a_finished_response_is_vllms_error(client: openai.OpenAI, model: str) -> None:
    made = client.responses.create(model=model, input="done", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.cancel(made.id)
    assert error_body(refused.value)["message"] == "Cannot cancel a synchronous response."
    assert error_body(refused.value)["param"] == "response_id"


def test_cache_salt_keeps_tenants_caches_apart(client: openai.OpenAI, model: str) -> None:
    prompt = "a prompt no other test sends, long enough to fill a few blocks"

    def cached(salt: str) -> int:
        made = client.responses.create(
            model=model, input=prompt, max_output_tokens=1, extra_body={"cache_salt": salt}
        )
        assert made.usage is not None
        return made.usage.input_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") > 0


def test_logprobs_come_with_the_include(client: openai.OpenAI, model: str) -> None:
    made = client.responses.create(
        model=model,
        input="odds",
        max_output_tokens=3,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
        extra_body=FILL,
    )
    assert made.top_logprobs == 2
    (item,) = made.output
    assert item.type == "message"
    part = item.content[0]
    assert part.type == "output_text" and part.logprobs is not None and len(part.logprobs) == 3
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"model": "gpt-17"}, 404, "model"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, 400, "tools"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"text": {"format": {"type": "json_object"}}}, 400, "text.format"),
        ({"background": True}, 400, "background"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": 7}, 400, "input"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
        ({"input": "hello world " * 200}, 400, "input"),
        ({"include": ["everything"]}, 400, "include"),
        ({"temperature": 3}, 400, "temperature"),
        ({"metadata": "a"}, 400, "metadata"),  # (it was kept and echoed back)
        ({"metadata": {"k": 7}}, 400, "metadata"),
    ],
)
def test_what_the_engine_cannot_do_is_refused_naming_the_field(
    client: openai.OpenAI, model: str, fields: dict[str, Any], status: int, param: str
) -> None:
    body = {"model": model, "input": "x", **fields}
    with pytest.raises(openai.APIStatusError) as refused:
        client.post("/responses", body=body, cast_to=object)
    assert refused.value.status_code == status
    assert error_body(refused.value)["param"] == param
