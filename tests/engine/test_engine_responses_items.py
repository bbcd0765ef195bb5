"""``GET /v1/responses/{id}/input_items`` of kvgate's engine, as the official openai SDK lists them
(``client.responses.input_items.list``): the items a stored response was generated from, a page at a time,
and the 404 and 400s it answers."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.engine.test_engine_responses import FILL, engine_process, error_body


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[openai.OpenAI]:
    with (
        engine_process(tiny_model_dir) as url,
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def listed(client: openai.OpenAI, response_id: str, **query: Any) -> dict[str, Any]:
    """The list as the engine sent it (the SDK's page keeps only data and has_more)."""
    page = client.get(f"/responses/{response_id}/input_items", options={"params": query}, cast_to=object)
    assert isinstance(page, dict)
    return page


def test_a_string_input_is_one_user_message_with_its_id_kept(client: openai.OpenAI, model: str) -> None:
    made = client.responses.create(model=model, input="hello there", max_output_tokens=1)
    page = client.responses.input_items.list(made.id)
    (item,) = page.data
    assert item.type == "message" and item.role == "user" and item.status == "completed"
    assert item.id.startswith("msg_") and item.id != made.output[0].id
    (part,) = item.content
    assert part.type == "input_text" and part.text == "hello there"
    assert page.has_more is False
    body = listed(client, made.id)
    assert body == {
        "object": "list",
        "data": [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "hello there"}],
                "id": item.id,
                "status": "completed",
            }
        ],
        "first_id": item.id,
        "last_id": item.id,
        "has_more": False,
    }
    assert listed(client, made.id) == body  # the same ids every time


# (Typed loosely: the SDK's input message type has no id, which an item may carry.)
INPUT: list[Any] = [
    {"role": "developer", "content": "answer in French"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q1"}], "id": "msg_mine"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "q2"},
    {"role": "user", "content": [{"type": "input_text", "text": "q3"}, {"type": "input_text", "text": "!"}]},
]


def test_items_keep_their_fields_and_are_paged_by_limit_after_and_order(
    client: openai.OpenAI, model: str
) -> None:
    made = client.responses.create(model=model, input=INPUT, max_output_tokens=1)
    everything = listed(client, made.id, order="asc")["data"]
    assert [(i["type"], i["role"], i["status"]) for i in everything] == [
        ("message", "developer", "completed"),
        ("message", "user", "completed"),
        ("message", "assistant", "completed"),
        ("message", "user", "completed"),
        ("message", "user", "completed"),
    ]
    assert everything[1] == {**INPUT[1], "status": "completed"}  # (its own id kept)
    assert everything[2]["content"] == [{"type": "output_text", "text": "a1", "annotations": []}]
    assert everything[4]["content"] == INPUT[4]["content"]
    ids = [i["id"] for i in everything]
    assert len(set(ids)) == 5 and ids[1] == "msg_mine"
    # Newest first by default; the SDK's auto-pagination asks for each next page with after=<last id>.
    assert listed(client, made.id)["data"] == everything[::-1]
    ascending = client.responses.input_items.list(made.id, limit=2, order="asc")
    assert [i.id for i in ascending] == ids
    assert [i.id for i in client.responses.input_items.list(made.id, limit=2)] == ids[::-1]
    first = listed(client, made.id, order="asc", limit=2)
    assert (first["first_id"], first["last_id"], first["has_more"]) == (ids[0], ids[1], True)
    rest = listed(client, made.id, order="asc", limit=2, after=ids[2])
    assert [i["id"] for i in rest["data"]] == ids[3:] and rest["has_more"] is False
    last = listed(client, made.id, order="desc", limit=3, after=ids[3])
    assert [i["id"] for i in last["data"]] == ids[2::-1] and last["has_more"] is False
    empty = listed(client, made.id, order="asc", after=ids[4])
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    with_include = client.responses.input_items.list(
        made.id, include=["message.input_image.image_url", "web_search_call.results"]
    )
    assert [i.id for i in with_include] == ids[::-1]


def test_a_continued_response_lists_the_items_of_the_turns_before_it(
    client: openai.OpenAI, model: str
) -> None:
    """As OpenAI's: the items the response was generated from, so the earlier turns' input and output too
    (as the prompt holds them: an earlier system message is not carried over, nor are instructions)."""
    first = client.responses.create(
        model=model,
        input=[{"role": "system", "content": "be terse"}, {"role": "user", "content": "tell me a story"}],
        instructions="be brief",
        max_output_tokens=3,
        extra_body=FILL,
    )
    second = client.responses.create(
        model=model, previous_response_id=first.id, input="and then?", max_output_tokens=3, extra_body=FILL
    )
    third = client.responses.create(
        model=model, previous_response_id=second.id, input="the end", max_output_tokens=1
    )
    before = listed(client, first.id, order="asc")["data"]
    assert [i["role"] for i in before] == ["system", "user"]
    items = list(client.responses.input_items.list(third.id, order="asc"))
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert items[0].id == before[1]["id"]  # the same item, with the same id, as the first response lists
    assert [items[1].id, items[3].id] == [first.output[0].id, second.output[0].id]
    assert items[1].model_dump(exclude_none=True) == first.output[0].model_dump(exclude_none=True)
    texts = [i.model_dump()["content"][0]["text"] for i in items]
    assert texts == ["tell me a story", first.output_text, "and then?", second.output_text, "the end"]
    assert [i.id for i in client.responses.input_items.list(second.id, order="asc")] == [
        i.id for i in items[:3]
    ]


def test_items_sent_with_an_id_already_listed_are_paged_once_each(client: openai.OpenAI, model: str) -> None:
    """A client may send an id twice (the same message item twice, or an earlier turn's output again with
    its ``previous_response_id``). The SDK pages with ``after=<last id>``, so a repeated id in one listing
    sent it back to the first of them: its auto-pagination went round the same items forever."""
    twice: list[Any] = [
        {"type": "message", "role": "user", "content": "x"},
        {"type": "message", "id": "msg_twice", "role": "user", "content": "a"},
        {"type": "message", "role": "user", "content": "y"},
        {"type": "message", "id": "msg_twice", "role": "user", "content": "b"},
    ]
    made = client.responses.create(model=model, input=twice, max_output_tokens=1)
    pages = client.responses.input_items.list(made.id, limit=1)
    texts = [i.model_dump()["content"][0]["text"] for i in itertools.islice(pages, 6)]  # (bounded: it looped)
    assert texts == ["b", "y", "a", "x"]
    ids = [i["id"] for i in listed(client, made.id, order="asc")["data"]]
    assert len(set(ids)) == 4 and ids[1] == "msg_twice"  # (the first keeps the id it was sent with)
    # An earlier turn's output sent again as input, with its id, after the previous_response_id.
    again = client.responses.create(
        model=model,
        previous_response_id=made.id,
        input=[made.output[0].model_dump(exclude_none=True), {"role": "user", "content": "z"}],
        max_output_tokens=1,
    )
    listed_again = [i.id for i in itertools.islice(client.responses.input_items.list(again.id, limit=2), 9)]
    assert len(listed_again) == len(set(listed_again)) == 7


def test_an_unknown_or_unstored_response_is_vllms_404(client: openai.OpenAI, model: str) -> None:
    unstored = client.responses.create(model=model, input="forget me", max_output_tokens=1, store=False)
    for response_id in ("resp_nope", unstored.id):
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.input_items.list(response_id)
        assert error_body(missing.value) == {
            "message": f"Response with id '{response_id}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": None,
        }


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"order": "newest"}, "order"),
        ({"after": "msg_nobody_made"}, "after"),
        ({"include[]": "everything"}, "include"),
    ],
)
def test_bad_parameters_are_a_400_naming_them(
    client: openai.OpenAI, model: str, query: dict[str, Any], param: str
) -> None:
    made = client.responses.create(model=model, input="page me", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as refused:
        listed(client, made.id, **query)
    assert error_body(refused.value)["param"] == param
    assert error_body(refused.value)["type"] == "invalid_request_error"
