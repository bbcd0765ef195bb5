"""The SSE usage tap: forwards events untouched, finds the usage, drops it only when not asked for."""

from __future__ import annotations

import orjson
import pytest

from gateway.http.sse import SseUsageTap

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
USAGE_EVENT = b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + b"\n\n"
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("forward", [True, False])
def test_usage_is_captured_and_forwarded_only_on_request(forward: bool) -> None:
    tap = SseUsageTap(forward_usage_event=forward)
    out = tap.feed(CHUNK + CHUNK + USAGE_EVENT + DONE)
    assert tap.usage == USAGE and tap.saw_done
    assert out == (CHUNK + CHUNK + (USAGE_EVENT if forward else b"") + DONE)


def test_events_split_across_reads_are_reassembled() -> None:
    tap = SseUsageTap(forward_usage_event=False)
    stream = CHUNK + USAGE_EVENT + DONE
    out = b"".join(tap.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + tap.flush()
    assert out == CHUNK + DONE and tap.usage == USAGE


def test_crlf_events_and_null_usage_in_content_chunks() -> None:
    tap = SseUsageTap(forward_usage_event=False)
    content = b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\r\n\r\n'
    out = tap.feed(content + USAGE_EVENT.replace(b"\n\n", b"\r\n\r\n"))
    assert out == content and tap.usage == USAGE


def test_an_unterminated_last_event_is_dropped_unless_it_is_done() -> None:
    # An SSE client drops an event its stream cut short; the relay writes its own error event after it.
    tap = SseUsageTap(forward_usage_event=True)
    assert tap.feed(b"data: partial") == b""
    assert tap.flush() == b"" and not tap.saw_done
    for done in (b"data: [DONE]", b"data:[DONE]\r\n", b"data: [DONE]\n"):
        tap = SseUsageTap(forward_usage_event=True)
        assert tap.feed(CHUNK + done) == CHUNK and not tap.saw_done
        assert tap.flush() == done.strip() + b"\n\n" and tap.saw_done and tap.token_events == 1


def test_done_is_a_line_of_its_own_not_a_tokens_text() -> None:
    tap = SseUsageTap(forward_usage_event=True)
    tap.feed(b'data: {"choices":[{"index":0,"delta":{"content":"data: [DONE]"}}]}\n\n')
    assert not tap.saw_done
    tap.feed(b"data:[DONE]\r\n\r\n")
    assert tap.saw_done


def test_the_usage_event_gains_the_annotation_and_events_are_counted() -> None:
    tap = SseUsageTap(forward_usage_event=True, annotate=lambda usage: {"cost": usage["prompt_tokens"] / 1e6})
    out = tap.feed(CHUNK + CHUNK + USAGE_EVENT + DONE)
    events = [e for e in out.split(b"\n\n") if e]
    assert orjson.loads(events[2][6:])["usage"] == {**USAGE, "cost": 40 / 1e6}
    assert events[0] == CHUNK.strip() and events[3] == DONE.strip()
    assert tap.usage == USAGE  # billing reads the engine's own usage, not the annotated copy
    assert tap.events == 4


ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'


def test_token_events_leave_out_the_role_announcement_and_done() -> None:
    """A stream cut short is billed one completion token per event carrying one: the chat role chunk that
    opens a stream and the closing [DONE] carry none."""
    tap = SseUsageTap(forward_usage_event=False)
    tap.feed(ROLE + CHUNK[:20])
    tap.feed(CHUNK[20:] + CHUNK)
    assert tap.token_events == 2
    tap.feed(DONE)
    assert tap.token_events == 2
    completions = SseUsageTap(forward_usage_event=False)  # legacy completions announce no role
    completions.feed(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n' * 3)
    assert completions.token_events == 3
    first_has_content = SseUsageTap(forward_usage_event=False)
    first_has_content.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}\n\n' + CHUNK)
    assert first_has_content.token_events == 2


def test_an_engines_error_event_is_forwarded_noted_and_carries_no_token() -> None:
    tap = SseUsageTap(forward_usage_event=False)
    error = b'data: {"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}\n\n'
    word = b'data: {"choices":[{"index":0,"delta":{"content":"error"}}],"error":null}\n\n'  # a token
    assert tap.feed(ROLE + CHUNK + word) == ROLE + CHUNK + word and tap.error is None
    assert tap.feed(error + DONE) == error + DONE
    assert tap.error == {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}
    assert tap.token_events == 2


def test_only_the_usage_chunk_carries_the_final_usage() -> None:
    """vLLM's continuous_usage_stats puts a running usage in chunks with choices: it is forwarded with them,
    but only the usage chunk (``choices: []``) is the count to bill."""
    running = {"prompt_tokens": 40, "completion_tokens": 1}
    chunk = b"data: " + orjson.dumps(
        {"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": running}
    )
    tap = SseUsageTap(forward_usage_event=False)
    assert tap.feed(chunk + b"\n\n") == chunk + b"\n\n"
    assert tap.usage == running and tap.final_usage is None
    assert tap.feed(USAGE_EVENT + DONE) == DONE
    assert tap.usage == tap.final_usage == USAGE


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_sse_line_ending_byte_by_byte_with_comments_and_spaceless_data(eol: bytes) -> None:
    # SSE allows \n, \r\n and a lone \r as line ends; proxies add ": keep-alive" comments; "data:" needs no
    # space. Fed one byte at a time, the usage, the error event and [DONE] are still found.
    error = b'data:{"error":{"message":"oom"}}'
    usage = b"data:" + orjson.dumps({"choices": [], "usage": USAGE})
    lines = [b": keep-alive", b"", CHUNK.strip(), b"", usage, b"", error, b"", b"data:[DONE]", b""]
    stream = eol.join(lines) + eol
    tap = SseUsageTap(forward_usage_event=True)
    out = b"".join(tap.feed(stream[i : i + 1]) for i in range(len(stream))) + tap.flush()
    assert out == stream and tap.usage == USAGE and tap.error == {"message": "oom"} and tap.saw_done


def test_an_event_of_several_data_lines_is_one_event_and_a_comment_is_none() -> None:
    # SSE (WHATWG): an event is the block of lines up to a blank line; its data lines are one event's data,
    # joined with newlines; a line starting with ":" is a comment, and a block without data is no event.
    two_lines = b'data: {"choices":[{"index":0,\ndata: "delta":{"content":"hi"}}]}\n\n'
    comment = b": keep-alive, no data: here\n\n"
    tap = SseUsageTap(forward_usage_event=False)
    stream = ROLE + two_lines + comment + b"event: ping\nid: 7\n\n" + CHUNK + DONE
    assert tap.feed(stream) == stream
    assert tap.events == 4 and tap.token_events == 2  # role, the two-line token, CHUNK, [DONE]
    usage = b"data: " + orjson.dumps({"choices": [], "usage": USAGE}).replace(b',"usage"', b',\ndata:"usage"')
    tap = SseUsageTap(forward_usage_event=True)
    assert tap.feed(ROLE + two_lines + comment + usage + b"\n\n" + DONE) == ROLE + two_lines + comment + (
        usage + b"\n\n" + DONE
    )
    assert tap.usage == USAGE and tap.events == 4  # its two data lines are parsed as one JSON, too


def test_a_data_line_naming_data_inside_a_token_is_still_one_event() -> None:
    # A token's text may say "data:" (or "\ndata:" escaped in its JSON): one event, one token.
    token = b'data: {"choices":[{"index":0,"delta":{"content":"data: x\\ndata: y"}}]}\n\n'
    tap = SseUsageTap(forward_usage_event=False)
    assert tap.feed(ROLE + token + token) == ROLE + token + token
    assert tap.events == 3 and tap.token_events == 2
    tap.feed(USAGE_EVENT.replace(b"[]", b'[{"index":0,"delta":{"content":"data:"}}]') + DONE)
    assert tap.events == 5 and tap.token_events == 3


def test_a_large_event_in_many_reads_is_searched_once_not_once_per_read() -> None:
    # A 4 MB event (a huge token, an echoed prompt) in 4 KB reads: searching the whole buffered event for
    # its end again on every read costs O(n^2); only each read's new bytes (and a separator's overlap) need
    # searching.
    head, tail = b'data: {"choices":[{"index":0,"delta":{"content":"', b'"}}]}\r\n\r\n'
    event = head + b"x" * (4 * 1024 * 1024) + tail
    tap = SseUsageTap(forward_usage_event=False)
    out = b"".join(tap.feed(event[i : i + 4096]) for i in range(0, len(event), 4096))
    assert out == event and tap.events == 1 and tap.token_events == 1
    assert tap.scanned < 2 * len(event)


@pytest.mark.parametrize("blank", [b"\n\r\n", b"\r\n\n"])
@pytest.mark.parametrize("read", [1, 0], ids=["byte_by_byte", "one_read"])
def test_an_event_ended_by_mixed_line_ends_is_an_event(blank: bytes, read: int) -> None:
    # A line ends in \n, \r\n or a lone \r, and a blank line (two line ends in a row) ends an event, whichever
    # two: "\n" then "\r\n" is one. Such events were held back until the stream ended, then dropped.
    error = b'data: {"error":{"message":"oom"}}'
    usage = b"data: " + orjson.dumps({"choices": [], "usage": USAGE})
    stream = blank.join([ROLE.strip(), CHUNK.strip(), usage, error, b"data: [DONE]"]) + blank
    tap = SseUsageTap(forward_usage_event=True)
    reads = [stream[i : i + 1] for i in range(len(stream))] if read else [stream]
    out = b"".join(tap.feed(data) for data in reads) + tap.flush()
    assert out == stream and tap.saw_done
    assert tap.usage == USAGE and tap.error == {"message": "oom"}
    assert tap.events == 5 and tap.token_events == 2  # the role, error and [DONE] carry none


@pytest.mark.parametrize("forward", [True, False])
def test_a_read_whose_events_end_in_different_line_ends_is_split_event_by_event(forward: bool) -> None:
    # A read may hold events of different line endings (an engine's, a proxy's comment): it was split on the
    # first blank line style found in it, so a \n\n-ended token and the \r\n\r\n-ended usage after it were
    # parsed as one event: the usage was not found (nor dropped), and the stream billed by estimate.
    crlf_usage = USAGE_EVENT.replace(b"\n\n", b"\r\n\r\n")
    tap = SseUsageTap(forward_usage_event=forward)
    out = tap.feed(CHUNK + crlf_usage + b": keep-alive\r\r" + DONE)
    assert tap.usage == tap.final_usage == USAGE and tap.saw_done
    assert out == CHUNK + (crlf_usage if forward else b"") + b": keep-alive\r\r" + DONE
    assert tap.events == (3 if forward else 2)
    annotated = SseUsageTap(forward_usage_event=True, annotate=lambda usage: {"cost": 1})
    out = annotated.feed(CHUNK + crlf_usage + DONE)
    cost = b"data: " + orjson.dumps({"choices": [], "usage": {**USAGE, "cost": 1}}) + b"\r\n\r\n"
    assert out == CHUNK + cost + DONE and annotated.usage == USAGE


def test_nothing_after_done_is_forwarded_or_read() -> None:
    # [DONE] ends the stream (the SDK stops reading there): what an engine sends after it, in the same read or
    # later, is no part of the answer: neither forwarded nor taken for its usage or its error.
    late = b'data: {"error":{"message":"late"}}\n\n' + USAGE_EVENT.replace(b"40", b"99") + CHUNK
    tap = SseUsageTap(forward_usage_event=True)
    assert tap.feed(CHUNK + USAGE_EVENT + DONE + late + b"data: partial") == CHUNK + USAGE_EVENT + DONE
    assert tap.feed(late) == b"" and tap.flush() == b""
    assert tap.saw_done and tap.error is None and tap.usage == tap.final_usage == USAGE
    assert tap.events == 3
    crlf = SseUsageTap(forward_usage_event=False)
    assert crlf.feed(b"data: [DONE]\r\n\r\n" + late) == b"data: [DONE]\r\n\r\n" and crlf.events == 1
