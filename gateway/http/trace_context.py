"""W3C Trace Context (``traceparent``, ``tracestate``) passed from the client to the engines.

vLLM (``--otlp-traces-endpoint``) and SGLang continue the trace a request's ``traceparent`` names; a
gateway that dropped it cut every client's trace at the gateway. kvgate takes no part in the trace (it
records no span of its own): it forwards the client's context unchanged to each engine the request goes
to, the prefill half of a disaggregated request included, as a transparent proxy does.

A ``traceparent`` that is not one (the format of version 00, or of a later version's first four fields;
version ff, an all-zero trace or parent id) is not forwarded, nor is the ``tracestate`` beside it: the
specification has a receiver then start a new trace, which is what the engine does with none. A
``tracestate`` goes with a valid ``traceparent`` only, when it is printable ASCII and at most 512 characters
(the size the specification asks every vendor to pass on); several ``tracestate`` headers are one list,
joined with commas, and several ``traceparent`` headers are none valid.
"""

from __future__ import annotations

import re

from multidict import MultiMapping

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACESTATE_MAX_CHARS = 512

# version-traceid-parentid-flags, lower-case hex; a later version may add fields after a dash (passed on
# when they are visible ASCII: they go into a header of the engine's request).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[\x21-\x7e]*)?")
_TRACESTATE = re.compile(r"[\x20-\x7e]*")
_ZERO_TRACE_ID, _ZERO_PARENT_ID = "0" * 32, "0" * 16

NO_TRACE: tuple[tuple[str, str], ...] = ()


def trace_headers(headers: MultiMapping[str]) -> tuple[tuple[str, str], ...]:
    """The client's trace context as headers for an engine; empty when it sent none, or none valid."""
    if TRACEPARENT not in headers:  # (the common case: one lookup)
        return NO_TRACE
    parents = headers.getall(TRACEPARENT)
    if len(parents) != 1:
        return NO_TRACE
    parent = parents[0].strip(" \t")
    match = _TRACEPARENT.fullmatch(parent)
    if match is None:
        return NO_TRACE
    version, trace_id, parent_id, _, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return NO_TRACE
    if trace_id == _ZERO_TRACE_ID or parent_id == _ZERO_PARENT_ID:
        return NO_TRACE
    states = headers.getall(TRACESTATE, ())
    if not states:
        return ((TRACEPARENT, parent),)
    state = ",".join(s.strip(" \t") for s in states)
    if not state or len(state) > TRACESTATE_MAX_CHARS or _TRACESTATE.fullmatch(state) is None:
        return ((TRACEPARENT, parent),)
    return (TRACEPARENT, parent), (TRACESTATE, state)
