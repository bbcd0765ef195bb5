"""A stored response's input items, as OpenAI's ``GET /v1/responses/{id}/input_items`` lists them (vLLM 0.32
has no such route): the request's ``input`` as items, each with an ``id`` and a ``status``, listed a page
at a time (``limit``, ``order``, ``after``) as ``{"object": "list", "data", "first_id", "last_id",
"has_more"}``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.openai_api import new_id
from engine.openai_errors import OpenAIError
from engine.responses_request import INCLUDABLE
from engine.responses_store import StoredResponse

DEFAULT_LIMIT, MAX_LIMIT = 20, 100
# What the SDK's ResponseIncludable may name here: the Responses ``include`` values, and the web search ones
# vLLM does not take on a create. None changes what is listed (this engine keeps no images nor searches).
_INCLUDABLE = INCLUDABLE | {"web_search_call.results", "web_search_call.action.sources"}
# An item's id as OpenAI begins it, by the item's type.
_ID_PREFIXES = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "custom_tool_call": "ctc_",
    "custom_tool_call_output": "ctco_",
    "reasoning": "rs_",
}

Items = tuple[dict[str, Any], ...]


def input_items(raw_input: str | Sequence[Mapping[str, Any]], previous: StoredResponse | None) -> Items:
    """The items a response was generated from, in the order the prompt holds them.

    A continued response's items begin with those of the responses before it, then the previous response's
    output, as OpenAI's list does ("the items used to generate this response"; a ``conversation``'s items
    are "prepended to input_items" too), and as the prompt holds them: so a system message item of an
    earlier turn is left out, as the prompt leaves it out (vLLM carries no system message into the next
    turn). The earlier items are shared with the earlier responses, not copied: each stored response adds
    only its own input, and every item goes when the last response that lists it leaves the store.
    ``raw_input`` was checked when the request was parsed (a string, or items that are objects).

    Ids are unique within the list: an item sent with an id already listed (the same item twice, or an
    earlier turn's output sent again after its ``previous_response_id``) gets a new one. OpenAI refuses
    such input and vLLM takes it. Listed twice, an id the SDK sent as ``after`` (its cursor) led back to the
    first of them, and its pagination went round the same items forever."""
    items: list[dict[str, Any]] = []
    if previous is not None:
        items.extend(i for i in previous.input_items if not _is_system_message(i))
        items.extend(previous.response["output"])
    listed = {item.get("id") for item in items}
    given = (
        [{"type": "message", "role": "user", "content": raw_input}]
        if isinstance(raw_input, str)
        else raw_input
    )
    for one in given:
        item = _item(one)
        if item["id"] in listed:
            item["id"] = new_id(_ID_PREFIXES.get(item["type"], "item_"))
        listed.add(item["id"])
        items.append(item)
    return tuple(items)


def _is_system_message(item: Mapping[str, Any]) -> bool:
    return item.get("type") == "message" and item.get("role") == "system"


def _item(given: Mapping[str, Any]) -> dict[str, Any]:
    """An input item as listed: its own fields, with the id it was given (or a new one), a ``status`` (which
    OpenAI fills in for listed items), and a message's string content as one text part (the SDK's message
    items hold a list of parts)."""
    item = dict(given)
    if item.get("type") is None and "role" in item:  # (an "easy" message: role and content only)
        item["type"] = "message"
    content = item.get("content")
    if item["type"] == "message" and isinstance(content, str):
        item["content"] = [
            {"type": "output_text", "text": content, "annotations": []}
            if item.get("role") == "assistant"
            else {"type": "input_text", "text": content}
        ]
    if item.get("id") is None:
        item["id"] = new_id(_ID_PREFIXES.get(item["type"], "item_"))
    if item.get("status") is None:
        item["status"] = "completed"
    return item


def items_page(items: Items, query: Mapping[str, str], *, includes: Sequence[str] = ()) -> dict[str, Any]:
    """One page of ``items`` as the query asks for it; an :class:`OpenAIError` (400) naming a parameter the
    query got wrong. ``includes``: the query's ``include`` values (``include[]=...``, as the SDK sends
    them, or ``include=...``)."""
    limit = _limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError("order must be 'asc' or 'desc'", param="order")
    for value in includes:
        if value not in _INCLUDABLE:
            raise OpenAIError(f"include cannot name {value[:100]!r}", param="include")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    after = query.get("after")
    if after is not None:
        at = next((n for n, item in enumerate(ordered) if item["id"] == after), None)
        if at is None:
            raise OpenAIError(f"no input item of this response has the id {after[:200]!r}", param="after")
        start = at + 1
    data = list(ordered[start : start + limit])
    return {
        "object": "list",
        "data": data,
        # (OpenAI's lists say null for an empty page, where the SDK's type has a string)
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise OpenAIError(
            f"limit must be an integer from 1 to {MAX_LIMIT}, got {value[:20]!r}", param="limit"
        )
    return limit
