"""W3C Trace Context from the client to the engines (gateway.http.trace_context): a valid ``traceparent``
and its ``tracestate`` reach every engine the request goes to; anything else reaches none."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.http.trace_context import trace_headers
from tests.faulty_engines import recorded_gateway
from tests.harness import MODEL, ClusterFactory

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"  # the specification's example


def headers(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


def test_a_valid_context_is_forwarded_as_sent() -> None:
    assert trace_headers(headers()) == ()
    assert trace_headers(headers(("TraceParent", PARENT))) == (("traceparent", PARENT),)
    assert trace_headers(headers(("traceparent", f" {PARENT}\t"), ("tracestate", "congo=t61rcWkgMzE"))) == (
        ("traceparent", PARENT),
        ("tracestate", "congo=t61rcWkgMzE"),
    )
    # Several tracestate headers are one list; a later version may add fields, and is passed on whole.
    two = headers(("traceparent", PARENT), ("tracestate", "a=1"), ("tracestate", "b=2"))
    assert trace_headers(two)[1] == ("tracestate", "a=1,b=2")
    later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next"
    assert trace_headers(headers(("traceparent", later))) == (("traceparent", later),)


@pytest.mark.parametrize(
    "parent",
    [
        PARENT.upper(),  # (lower-case hex only)
        "ff" + PARENT[2:],  # version ff is invalid
        PARENT + "-more",  # version 00 has exactly four fields
        "00-" + "0" * 32 + PARENT[35:],  # an all-zero trace id
        PARENT[:36] + "0" * 16 + "-01",  # an all-zero parent id
        PARENT[:-1],
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "",
        "x" * 10_000,
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-\x00",  # (a later version's fields go
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-a b",  # into a header: visible ASCII)
    ],
)
def test_an_invalid_traceparent_and_its_tracestate_go_nowhere(parent: str) -> None:
    assert trace_headers(headers(("traceparent", parent), ("tracestate", "a=1"))) == ()


def test_a_tracestate_that_cannot_be_passed_on_is_dropped_and_the_parent_kept() -> None:
    for state in ("a=1\r\nx-injected: 1", "a=\x00", "k=" + "v" * 600, " "):
        assert trace_headers(headers(("traceparent", PARENT), ("tracestate", state))) == (
            ("traceparent", PARENT),
        )
    twice = headers(("traceparent", PARENT), ("traceparent", PARENT))
    assert trace_headers(twice) == ()  # (which one would the client mean?)


async def test_the_engine_gets_the_clients_trace_context(make_cluster: ClusterFactory) -> None:
    cluster, recorder = await recorded_gateway(make_cluster)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    sent = {"traceparent": PARENT, "tracestate": "congo=t61rcWkgMzE"}
    status, _, _ = await cluster.post("/v1/chat/completions", body, headers=sent)
    assert status == 200
    status, _, _ = await cluster.post("/v1/chat/completions", body, headers={"traceparent": "00-bad"})
    assert status == 200  # (an invalid context fails nothing: it is only not passed on)
    await cluster.post("/v1/chat/completions", body)
    got = [(h.get("traceparent"), h.get("tracestate")) for h in recorder.headers]
    assert got == [(PARENT, "congo=t61rcWkgMzE"), (None, None), (None, None)]
