"""Bad input gets a clear OpenAI-shaped 4xx, never a 5xx and never a stack trace."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.tenancy.tenants import create_key
from tests.harness import MODEL, Cluster, start_cluster


class BackgroundCluster:
    """A cluster on its own event loop in a thread, so that synchronous (hypothesis) tests can call it."""

    def __init__(self, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cluster: Cluster = asyncio.run_coroutine_threadsafe(start_cluster(**kwargs), self.loop).result(
            30
        )
        host_port = self.cluster.url.removeprefix("http://")
        self.host, port = host_port.split(":")
        self.port = int(port)

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.cluster.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def gw() -> Iterator[BackgroundCluster]:
    cluster = BackgroundCluster(regions={"eu-west": 2}, max_body_bytes=64 * 1024, max_prompt_tokens=4096)
    yield cluster
    cluster.close()


def assert_openai_error(status: int, raw: bytes, expected_status: int | None = None) -> dict[str, Any]:
    assert 400 <= status < 500, (status, raw[:300])
    if expected_status is not None:
        assert status == expected_status, (status, raw[:300])
    body = json.loads(raw)
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def post(
    gw: BackgroundCluster,
    body: Any,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> tuple[int, bytes]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, data = gw.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
    return status, data


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_the_good_request_works(gw: BackgroundCluster) -> None:
    status, data = post(gw, GOOD)
    assert status == 200, data


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'"just a string"', None),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hello"}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": MODEL, "messages": [{"content": "x"}]}, "messages.0.role"),
        ({**GOOD, "max_tokens": "10"}, "max_tokens"),
        ({**GOOD, "max_tokens": 0}, "max_tokens"),
        ({**GOOD, "max_tokens": 10**9}, "max_tokens"),
        ({**GOOD, "temperature": "hot"}, "temperature"),
        ({**GOOD, "temperature": 7}, "temperature"),
        ({**GOOD, "stream": "yes"}, "stream"),
        ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**GOOD, "model": 42}, "model"),
        ({**GOOD, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        # What only the gateway tells an engine: a URL to fetch K/V from, another namespace's blocks, ids.
        (
            {**GOOD, "kv_transfer_params": {"pull_url": "http://10.0.0.1", "pull_tokens": 9}},
            "kv_transfer_params",
        ),
        ({**GOOD, "cache_shared_blocks": 4}, "cache_shared_blocks"),
        ({**GOOD, "bootstrap_host": "10.9.9.9"}, "bootstrap_host"),
        ({**GOOD, "bootstrap_room": 7}, "bootstrap_room"),
        ({**GOOD, "prompt_token_ids_hex": "00000001"}, "prompt_token_ids_hex"),  # a prompt not routed
        ({**GOOD, "prompt_token_ids": [1, 2, 3]}, "prompt_token_ids"),  # engines would read it, not messages
        # A message that must say something (OpenAI: content is required but for an assistant's tool calls).
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages.0.content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        (
            {"model": MODEL, "messages": [{"role": "system"}, {"role": "user", "content": "x"}]},
            "messages.0.content",
        ),
        # Tools: the engines behind this gateway cannot call them; a 200 that ignored them would be wrong.
        ({**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({**GOOD, "tool_choice": "required"}, "tool_choice"),
        ({**GOOD, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            },
            "messages",
        ),
    ],
)
def test_malformed_bodies(gw: BackgroundCluster, body: Any, param: str | None) -> None:
    status, data = post(gw, body)
    error = assert_openai_error(status, data, 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_completions_body_errors(gw: BackgroundCluster) -> None:
    cases = [
        ({"model": MODEL, "prompt": 5}, "prompt"),
        ({"model": MODEL, "prompt": [1, -2]}, "prompt"),
        ({"model": MODEL, "prompt": ["one", 5]}, "prompt"),  # (several prompts: test_prompt_batch.py)
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "x" * 5000}, "prompt"),
        # Nothing to prefill: the engine's refusal named the gateway's internal field instead.
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": [""]}, "prompt"),
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"model": MODEL, "prompt": [[]]}, "prompt"),
    ]
    for body, param in cases:
        status, data = post(gw, body, path="/v1/completions")
        assert assert_openai_error(status, data, 400)["param"] == param


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [300, 1000])
@pytest.mark.parametrize(
    ("path", "prefix", "suffix"),
    [
        ("/v1/chat/completions", json.dumps(GOOD)[:-1].encode() + b', "x": ', b"}"),
        (
            "/v1/chat/completions",
            b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", '
            b'"text": "hi", "x": ' % MODEL.encode(),
            b"}]}]}",
        ),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})[:-1].encode()
         + b', "x": ', b"}"),
    ],
    ids=["chat-field", "content-part-field", "completions-field"],
)  # fmt: skip
def test_a_body_nested_too_deeply_is_400_not_500(
    gw: BackgroundCluster, path: str, prefix: bytes, suffix: bytes, depth: int
) -> None:
    """JSON the gateway can read (orjson reads 1024 levels) but could not write to its engine (orjson writes
    254): a 400 saying so, not a 500 from the engine body's serialization. 100 levels go through."""
    status, data = post(gw, prefix + nested(depth) + suffix, path=path)
    error = assert_openai_error(status, data, 400)
    assert "nested" in error["message"]
    status, data = post(gw, prefix + nested(100) + suffix, path=path)
    assert status == 200, data[:300]


def test_a_too_long_prompt_says_so(gw: BackgroundCluster) -> None:
    status, data = post(gw, {"model": MODEL, "prompt": "x" * 5000}, path="/v1/completions")
    assert assert_openai_error(status, data, 400)["code"] == "context_length_exceeded"


def test_unknown_model_is_404(gw: BackgroundCluster) -> None:
    status, data = post(gw, {**GOOD, "model": "gpt-17"})
    assert assert_openai_error(status, data, 404)["code"] == "model_not_found"


def test_an_invalid_key_of_the_clients_is_named_cut(gw: BackgroundCluster) -> None:
    """A key of the client's own that the error's param names (here ``metadata``'s), as long as the body limit
    allows, is named by its first 64 characters, not sent back whole in the message and again in the param."""
    body = {"model": MODEL, "input": "hi", "metadata": {"m" * 60_000: 1}}
    status, data = post(gw, body, path="/v1/responses")
    error = assert_openai_error(status, data, 400)
    assert error["param"] == "metadata." + "m" * 64
    assert len(data) < 1000, len(data)


def test_oversized_body_is_413(gw: BackgroundCluster) -> None:
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * (100 * 1024)}]}
    status, data = post(gw, big)
    assert assert_openai_error(status, data, 413)["code"] == "request_too_large"


def test_oversized_body_without_content_length_is_413(gw: BackgroundCluster) -> None:
    conn = http.client.HTTPConnection(gw.host, gw.port, timeout=10)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.putheader("Content-Type", "application/json")
    conn.endheaders()
    payload = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * (100 * 1024)}]}).encode()
    for i in range(0, len(payload), 8192):
        part = payload[i : i + 8192]
        conn.send(b"%x\r\n%s\r\n" % (len(part), part))
    conn.send(b"0\r\n\r\n")
    response = conn.getresponse()
    assert_openai_error(response.status, response.read(), 413)
    conn.close()


@pytest.mark.parametrize(
    "value",
    ["", "x" * 257, "has space", "tab\there", "naïve", 'quote"ok\x7f'],
)
def test_bad_session_header_values(gw: BackgroundCluster, value: str) -> None:
    """Every bad value is a 400 OpenAI error; the ones HTTP itself forbids (DEL) are refused by the HTTP
    parser, before the gateway could name the header."""
    raw = value.encode("utf-8")
    conn = http.client.HTTPConnection(gw.host, gw.port, timeout=10)
    body = json.dumps(GOOD).encode()
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(body)))
    conn.putheader("x-session-affinity", raw)
    conn.endheaders(body)
    response = conn.getresponse()
    error = assert_openai_error(response.status, response.read(), 400)
    if "\x7f" in value:
        assert error["code"] == "bad_http_request"
    else:
        assert error["param"] == "x-session-affinity"
    conn.close()


def test_unknown_paths_and_methods_are_openai_errors(gw: BackgroundCluster) -> None:
    status, _, data = gw.request("GET", "/v1/nothing-here")
    assert_openai_error(status, data, 404)
    status, headers, data = gw.request("GET", "/v1/chat/completions")
    assert_openai_error(status, data, 405)
    assert headers["Allow"] == "POST"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, "other"]) | json_values,
        "messages": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "role": st.sampled_from(["user", "system", "x"]) | json_values,
                    "content": json_values,
                },
            ),
            max_size=3,
        )
        | json_values,
        "prompt": json_values,
        "max_tokens": st.integers(-5, 40) | json_values,
        "stream": st.booleans() | json_values,
        "temperature": json_values,
        "stop": json_values,
        "n": st.integers(-1, 3),
        "stream_options": json_values,
    },
)
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=bodies,
    session=st.none() | header_values,
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
)
def test_fuzzed_requests_never_get_a_5xx(
    gw: BackgroundCluster, body: dict[str, Any], session: str | None, path: str
) -> None:
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 4)  # keep generation short
    headers = {} if session is None else {"x-session-affinity": session.strip() or "-"}
    status, data = post(gw, body, headers, path)
    if status == 200:
        if body.get("stream") is True:
            assert data.endswith(b"data: [DONE]\n\n")
        else:
            assert "usage" in json.loads(data)
    else:
        assert_openai_error(status, data)


def test_oversized_headers_get_431_without_being_echoed(gw: BackgroundCluster) -> None:
    status, _, data = gw.request("POST", "/v1/chat/completions", json.dumps(GOOD).encode(),
                                 {"Authorization": "Bearer " + "s" * 20_000})  # fmt: skip
    error = assert_openai_error(status, data, 431)
    assert "sss" not in error["message"]
    status, _, data = gw.request(
        "POST", "/v1/chat/completions", json.dumps(GOOD).encode(), {f"x-h{i}": "v" for i in range(200)}
    )
    assert_openai_error(status, data, 431)


EDGE = "👩‍👩‍👧‍👦 \u202eabc e\u0301 \U0001f600 \ufffd"  # ZWJ family, RTL override, combining mark, emoji


@pytest.mark.parametrize(
    ("raw", "ok"),
    [
        (json.dumps({**GOOD, "messages": [{"role": "user", "content": "a\u0000b"}]}).encode(), True),
        (
            json.dumps(
                {**GOOD, "messages": [{"role": "user", "content": EDGE}]}, ensure_ascii=False
            ).encode(),
            True,
        ),
        (json.dumps({**GOOD, "messages": [{"role": "user", "content": "\U0010ffff" * 50}]}).encode(), True),
        (
            b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\\ud800"}]}',
            False,
        ),
        (
            b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xc0\xaf"}]}',
            False,
        ),
        (b"\xef\xbb\xbf" + json.dumps(GOOD).encode(), False),
        (json.dumps(GOOD).encode("utf-16"), False),
        (b"", False),
        (b"\x00" * 64, False),
    ],
)
def test_unicode_edge_cases(gw: BackgroundCluster, raw: bytes, ok: bool) -> None:
    status, data = post(gw, raw)
    if ok:
        assert status == 200, data[:300]
        assert json.loads(data)["usage"]["prompt_tokens"] > 0
    else:
        assert_openai_error(status, data, 400)


@pytest.fixture(scope="module")
def gw_billed() -> Iterator[BackgroundCluster]:
    """Authentication, prices and rate limits on: the paths that bill must survive bad input too."""
    cluster = BackgroundCluster(
        regions={"eu-west": 1},
        max_body_bytes=64 * 1024,
        auth={"enabled": True, "requests_per_minute": 100_000},
        tenants={"acme": {}, "ops": {"admin": True}},
        prices={MODEL: {"input": 1, "cached_input": 0.1, "output": 2}},
    )
    store = cluster.cluster.gateway.billing.keys
    cluster.key = asyncio.run_coroutine_threadsafe(create_key(store, "acme"), cluster.loop).result(10)[0]  # type: ignore[attr-defined]
    cluster.admin_key = asyncio.run_coroutine_threadsafe(create_key(store, "ops"), cluster.loop).result(10)[0]  # type: ignore[attr-defined]
    yield cluster
    cluster.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=bodies | st.binary(max_size=300).map(lambda b: {"__raw__": b}),
    authorization=st.sampled_from(["valid", "none"]) | header_values,
    extra=st.dictionaries(
        st.sampled_from(["x-request-id", "x-session-affinity", "cf-ipcountry", "x-forwarded-for", "accept"]),
        header_values.map(str.strip).filter(bool),
        max_size=3,
    ),
)
def test_fuzzed_requests_with_billing_never_get_a_5xx(
    gw_billed: BackgroundCluster, body: dict[str, Any], authorization: str, extra: dict[str, str]
) -> None:
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 4)
    headers = dict(extra)
    if authorization == "valid":
        headers["Authorization"] = f"Bearer {gw_billed.key}"  # type: ignore[attr-defined]
    elif authorization != "none" and authorization.strip():
        headers["Authorization"] = authorization.strip()
    raw = body.get("__raw__", body)
    status, data = post(gw_billed, raw, headers)
    if status == 200:
        if body.get("stream") is True:
            assert data.endswith(b"data: [DONE]\n\n")
        else:
            usage = json.loads(data)["usage"]
            assert usage["cost"] >= 0
    else:
        assert_openai_error(status, data)


query_values = st.one_of(
    st.text(max_size=40),
    st.integers(-(10**30), 10**30).map(str),
    st.dates().map(str),
    st.sampled_from(["", "today", "2026-02-30", "9999-12-31", "0001-01-01", "1e9", "²", "٣", " 1", "1 "]),
)
authorizations = st.one_of(
    st.sampled_from(["admin", "tenant", "none"]),
    header_values,
    header_values.map(lambda v: "Bearer " + v),
    st.sampled_from(["Bearer", "Bearer ", "bearer kvg-", "Basic kvg-x", "Bearer kvg-" + "x" * 4000]),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(
        ["/v1/usage", "/v1/admin/usage", "/v1/models", "/health", "/metrics", "/dashboard", "/dashboard/data"]
    ),
    query=st.dictionaries(st.sampled_from(["start", "end", "tenant", "x"]), query_values, max_size=3),
    authorization=authorizations,
)
def test_fuzzed_usage_admin_and_operator_reads_never_get_a_5xx(
    gw_billed: BackgroundCluster, path: str, query: dict[str, str], authorization: str
) -> None:
    headers = {}
    if authorization == "admin":
        headers["Authorization"] = f"Bearer {gw_billed.admin_key}"  # type: ignore[attr-defined]
    elif authorization == "tenant":
        headers["Authorization"] = f"Bearer {gw_billed.key}"  # type: ignore[attr-defined]
    elif authorization != "none" and authorization.strip():
        headers["Authorization"] = authorization.strip()
    target = path + ("?" + urllib.parse.urlencode(query) if query else "")
    status, _, data = gw_billed.request("GET", target, headers=headers)
    if status < 300:
        assert authorization in ("admin", "tenant") or path == "/health", (target, authorization)
        assert path not in ("/metrics", "/dashboard", "/dashboard/data") or authorization == "admin"
    else:
        error = assert_openai_error(status, data)
        if status == 401:
            assert "kvg-" + "x" * 40 not in error["message"]  # a key is never echoed whole
