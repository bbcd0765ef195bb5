"""Structured logs: JSON lines, one access line per request, and the request id carried to the engine."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import sys

import aiohttp
import pytest
from yarl import URL

from gateway.observability.logs import JsonFormatter, TextFormatter, escape_controls, unescape_controls
from tests.faulty_engines import recorded_gateway
from tests.harness import MODEL, ClusterFactory


def test_json_lines_carry_the_structured_fields() -> None:
    record = logging.LogRecord("kvgate.access", logging.INFO, __file__, 1, "request %s", ("finished",), None)
    record.fields = {"request_id": "r-1", "cached_tokens": 32, "ttft_s": 0.012}
    line = JsonFormatter().format(record)
    entry = json.loads(line)
    assert (
        entry["msg"] == "request finished" and entry["level"] == "info" and entry["logger"] == "kvgate.access"
    )
    assert entry["request_id"] == "r-1" and entry["cached_tokens"] == 32 and entry["ts"].endswith("+00:00")
    assert "\n" not in line
    assert TextFormatter().format(record).endswith("request_id=r-1 cached_tokens=32 ttft_s=0.012")


async def test_each_request_leaves_one_access_line(
    make_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await make_cluster(
        {"eu-west": 1}, prices={MODEL: {"input": 1, "cached_input": 0.1, "output": 2}}
    )
    assert cluster.session is not None
    caplog.set_level(logging.INFO, logger="kvgate.access")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "same words " * 20}], "max_tokens": 4}
    for i in range(2):
        async with cluster.session.post(
            cluster.url + "/v1/chat/completions",
            json={**body, "stream": True},
            headers={"x-request-id": f"client-{i}"},
        ) as r:
            await r.read()
            assert r.headers["x-request-id"] == f"client-{i}"
    lines = [r for r in caplog.records if r.name == "kvgate.access"]
    assert [r.fields["request_id"] for r in lines] == ["client-0", "client-1"]  # type: ignore[attr-defined]
    second = lines[1].fields  # type: ignore[attr-defined]
    assert (
        second["tenant"] == "default" and second["region"] == "eu-west" and second["engine"] == "eu-west/e0"
    )
    assert second["cached_tokens"] > 0 and second["ttft_s"] > 0 and second["cost_usd"] > 0
    assert json.loads(JsonFormatter().format(lines[1]))["cached_tokens"] == second["cached_tokens"]


async def test_the_request_id_travels_to_the_engine(make_cluster: ClusterFactory) -> None:
    cluster, recorder = await recorded_gateway(make_cluster)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    await cluster.post("/v1/chat/completions", body, headers={"x-request-id": "trace-me-42"})
    _, _, generated = await cluster.post("/v1/chat/completions", body)
    assert [h["X-Request-Id"] for h in recorder.headers] == ["trace-me-42", generated["x-request-id"]]
    assert generated["x-request-id"].startswith("req-")


async def test_json_lines_hold_bytes_a_client_sent_that_are_not_utf8(
    make_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A path's percent-escapes are decoded with ``surrogateescape``: ``%FF`` becomes a lone surrogate, which
    orjson refuses. Whatever record quotes it must still be one JSON line, not a "Logging error"."""
    cluster = await make_cluster({"eu-west": 1})
    assert cluster.session is not None
    caplog.set_level(logging.INFO)
    with contextlib.suppress(aiohttp.ClientError):  # (what the client got is the other test's)
        async with cluster.session.get(URL(cluster.url + "/v1/models/%FF%0Aforged", encoded=True)) as r:
            await r.read()
    record = logging.LogRecord(
        "kvgate.app", logging.ERROR, __file__, 1, "on %s", ("/v1/models/\udcff",), None
    )
    for rec in [*caplog.records, record]:
        line = JsonFormatter().format(rec)
        assert "\n" not in line and json.loads(line)["logger"] == rec.name


async def test_a_path_that_is_not_utf8_gets_its_404_and_no_error_log(
    make_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """``GET /v1/models/%FF``: the 404 quotes the model id, which held a lone surrogate; serializing it
    failed, so the client's connection was dropped unanswered, an ERROR traceback was logged per request
    and the request was not counted."""
    cluster = await make_cluster({"eu-west": 1})
    assert cluster.session is not None
    caplog.set_level(logging.INFO)
    async with cluster.session.get(URL(cluster.url + "/v1/models/%FFx", encoded=True)) as r:
        assert r.status == 404
        assert (await r.json())["error"]["message"] == "The model '\\udcffx' does not exist"
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR] == []
    async with cluster.session.get(cluster.url + "/metrics") as r:
        text = await r.text()
    assert 'kvgate_requests_total{endpoint="/v1/models/{model:path}",status="404"} 1.0' in text


def test_text_lines_escape_the_control_characters_a_client_sends() -> None:
    """A model name, request id or error text holding a newline or an ESC cannot forge or recolour a line."""
    forged = "kvgate-tiny\n2026-12-05 11:00:00,000 INFO kvgate.access: request finished tenant=admin"
    try:
        raise ValueError("engine said \r\x1b[2Jbye\x85")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "kvgate", logging.WARNING, __file__, 1, "no model %r %s", (1, forged), exc_info
    )
    record.fields = {"request_id": "r\n1", "tenant": "t\x00\u2028x", "path": "/v1/\udcff"}
    line = TextFormatter().format(record)
    assert line.splitlines() == [line]
    assert "\x1b" not in line and "\x00" not in line and "\x85" not in line
    assert "kvgate-tiny\\n2026-12-05" in line and "\\r\\x1b[2Jbye\\x85" in line
    assert "request_id=r\\n1 tenant=t\\x00\\u2028x path=/v1/\\udcff" in line
    line.encode()  # a lone surrogate from a client's non-UTF-8 bytes no longer makes the stream refuse it


def test_text_lines_escape_the_controls_that_reorder_what_a_terminal_shows() -> None:
    """A model name holding RIGHT-TO-LEFT OVERRIDE (a client names any model) showed the fields after it
    backwards (Trojan Source)."""
    record = logging.LogRecord("kvgate.access", logging.INFO, __file__, 1, "request finished", (), None)
    reorder = "\u202e\u202a\u202b\u202c\u202d\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
    record.fields = {"model": f"r{reorder}1", "tenant": "t"}
    line = TextFormatter().format(record)
    assert not set(reorder) & set(line), line
    assert "model=r\\u202e\\u202a" in line and unescape_controls(line).endswith(f"r{reorder}1 tenant=t")


def text_line(message: str) -> str:
    record = logging.LogRecord("kvgate", logging.INFO, __file__, 1, "%s", (message,), None)
    return TextFormatter().format(record)


def test_a_literal_backslash_n_and_a_newline_log_differently() -> None:
    """A client that sends a backslash and an ``n`` must not write what reads as an escaped newline: the
    backslash itself is escaped, so the line says which one the client sent."""
    literal, newline = text_line("model a\\nb"), text_line("model a\nb")
    assert literal != newline
    assert literal.endswith("model a\\\\nb") and newline.endswith("model a\\nb")
    assert unescape_controls(literal).endswith("model a\\nb")
    assert unescape_controls(newline).endswith("model a\nb")


REVERSIBLE = [
    "",
    "plain",
    "a\\nb",  # a backslash, then n
    "a\nb",  # a newline
    "\\",
    "\\x1b",  # a backslash, then the text of an escape
    "\\\\x1b",  # two of them
    "\\u2028 \\x00 \\t",
    "ends with a backslash \\",
    "\r\n\t\x1b[2J\x00\x7f\x85\x9f",
    "\u2028\u2029 para",
    "\u202e reversed \u2066isolated\u2069 \u200f",  # bidirectional controls
    "/v1/\udcff\ud800",  # lone surrogates (a client's bytes that are not UTF-8)
    "\\\n\\\\\n",  # backslashes and newlines interleaved
    "caf\u00e9 \u4e2d\U0001f600",  # printable non-ASCII passes as it is
]


@pytest.mark.parametrize("text", REVERSIBLE)
def test_text_lines_are_reversible(text: str) -> None:
    escaped = escape_controls(text)
    assert escaped.splitlines() == ([escaped] if escaped else [])
    assert "\x1b" not in escaped and "\x00" not in escaped
    assert unescape_controls(escaped) == text
    assert unescape_controls(text_line(text)).endswith(text)


def test_random_text_survives_escaping() -> None:
    # Strings made of what escaping touches (backslashes, the letters and digits of its escapes, controls,
    # separators, surrogates) next to what it leaves alone.
    alphabet = "\\nrtxu0123456789abcdefABCDEF \n\r\t\x00\x1b\x7f\x85\u2028\u2029\ud800\udcffé中"
    rng = random.Random(117)
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
        escaped = escape_controls(text)
        assert len(escaped.splitlines()) <= 1 and unescape_controls(escaped) == text, repr(text)
