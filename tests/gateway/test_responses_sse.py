"""The Responses API stream tap: events pass through untouched; the response's id, its usage (in its terminal
event, with the cost added) and its end are noted; nothing after the end is relayed. Events are written as
vLLM 0.32 writes them (``event:`` line, then the data, whose ``type`` comes last)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.http.responses_sse import ResponsesStreamTap
from gateway.tenancy.billing import usage_counts
from tests.responses_engine import USAGE
from tests.responses_engine import sse_event as event


def response(status: str, usage: dict[str, Any] | None = None, store: bool = True) -> dict[str, Any]:
    return {"id": "resp_abc", "object": "response", "status": status, "store": store, "usage": usage}


CREATED = event("response.created", 0, response=response("in_progress"))
IN_PROGRESS = event("response.in_progress", 1, response=response("in_progress"))
DELTAS = b"".join(
    event("response.output_text.delta", 2 + i, item_id="msg_1", output_index=0, content_index=0, delta=t)
    for i, t in enumerate(["Hel", "lo", "!"])
)
TEXT_DONE = event(
    "response.output_text.done", 5, item_id="msg_1", output_index=0, content_index=0, text="Hello!"
)
COMPLETED = event("response.completed", 6, response=response("completed", USAGE))
STREAM = CREATED + IN_PROGRESS + DELTAS + TEXT_DONE + COMPLETED


def test_a_whole_stream_passes_untouched_and_its_id_usage_and_end_are_noted() -> None:
    seen: list[dict[str, Any]] = []
    tap = ResponsesStreamTap(on_response=seen.append)
    assert tap.feed(STREAM) == STREAM
    assert tap.saw_done and tap.error is None
    assert tap.final_usage == USAGE and usage_counts(tap.final_usage) == (40, 32, 3)
    assert tap.response_id == "resp_abc" and [r["id"] for r in seen] == ["resp_abc"]  # (once)
    assert tap.token_events == 3


@pytest.mark.parametrize("size", [1, 7, 64])
def test_a_stream_in_any_reads_is_relayed_event_by_event(size: int) -> None:
    tap = ResponsesStreamTap()
    out = b"".join(tap.feed(STREAM[i : i + size]) for i in range(0, len(STREAM), size)) + tap.flush()
    assert out == STREAM and tap.final_usage == USAGE and tap.token_events == 3


def test_the_usage_the_client_sees_carries_its_cost() -> None:
    tap = ResponsesStreamTap(annotate=lambda usage: {"cost": usage["input_tokens"] / 1e6})
    out = tap.feed(STREAM)
    last = out[out.rindex(b"event: response.completed") :]
    assert last.startswith(b"event: response.completed\ndata: ") and last.endswith(b"\n\n")
    data = orjson.loads(last.split(b"data: ", 1)[1])
    assert data["response"]["usage"] == {**USAGE, "cost": 40e-6} and data["sequence_number"] == 6
    assert out[: -len(last)] == STREAM[: -len(COMPLETED)]  # (everything before it untouched)


def test_what_follows_the_terminal_event_is_neither_relayed_nor_billed() -> None:
    tap = ResponsesStreamTap()
    late = event("error", 7, code="x", message="late")
    assert tap.feed(STREAM + late) == STREAM
    assert tap.feed(late) == b"" and tap.error is None


@pytest.mark.parametrize(("terminal", "failed"), [("response.incomplete", False), ("response.failed", True)])
def test_an_incomplete_response_is_whole_and_a_failed_one_is_an_error(terminal: str, failed: bool) -> None:
    body = {
        **response("failed" if failed else "incomplete", USAGE),
        "error": {"code": "server_error", "message": "x"},
    }
    tap = ResponsesStreamTap()
    tap.feed(CREATED + DELTAS + event(terminal, 6, response=body))
    assert tap.saw_done and tap.final_usage == USAGE
    assert (tap.error is not None) is failed


@pytest.mark.parametrize(
    "error",
    [
        event("error", 5, code="server_error", message="the engine failed", param=None),
        b'data: {"error": {"message": "the engine failed", "type": "server_error"}}\n\n',
    ],
)
def test_an_error_event_is_forwarded_and_noted(error: bytes) -> None:
    tap = ResponsesStreamTap()
    assert tap.feed(CREATED + DELTAS + error) == CREATED + DELTAS + error
    assert tap.error is not None and not tap.saw_done and tap.final_usage is None


def test_a_stream_cut_before_its_end_is_not_whole_and_its_partial_event_is_dropped() -> None:
    tap = ResponsesStreamTap()
    out = tap.feed(CREATED + DELTAS + COMPLETED[:30])
    assert out == CREATED + DELTAS and tap.flush() == b""
    assert not tap.saw_done and tap.final_usage is None and tap.token_events == 3


def test_a_terminal_event_without_its_blank_line_still_ends_the_stream() -> None:
    tap = ResponsesStreamTap()
    out = tap.feed(STREAM[:-2]) + tap.flush()
    assert out == STREAM and tap.saw_done and tap.final_usage == USAGE


def test_crlf_lines_and_text_naming_events_are_read_as_events() -> None:
    tricky = event("response.output_text.delta", 2, delta='"type":"response.completed" data: {"error"')
    crlf = (CREATED + tricky + COMPLETED).replace(b"\n", b"\r\n")
    tap = ResponsesStreamTap()
    assert tap.feed(crlf) == crlf and tap.final_usage == USAGE and tap.token_events == 1


def test_a_responses_usage_is_counted_as_a_completions_usage_is() -> None:
    assert usage_counts(USAGE) == (40, 32, 3)
    chat = {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}}
    assert usage_counts(chat) == (40, 32, 3)
    assert usage_counts({"input_tokens": 5, "input_tokens_details": {"cached_tokens": 9}}) == (5, 5, 0)
