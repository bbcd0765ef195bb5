"""What an engine is sent: the client's body plus the gateway's additions, in the fields its kind reads.

- kvgate engines read everything the gateway adds: ``prompt_token_ids`` (or packed hex), ``cache_salt``,
  ``cache_shared_blocks`` and kvgate's own ``kv_transfer_params`` (pull or remote prefill).
- vLLM reads token ids only as ``/v1/completions``' ``prompt`` (its chat endpoint would silently ignore a
  ``prompt_token_ids``), ``cache_salt`` to keep tenants' prefix caches apart, and NixlConnector's
  ``kv_transfer_params`` for P/D.
- SGLang reads ids as ``prompt`` too and the bootstrap fields of its P/D; it has no ``cache_salt``.
- Any other OpenAI server gets the client's body and ``stream_options`` only: an unknown field may be
  refused there. Ids go to its ``/v1/completions`` only when the operator says it reads them.

Ids replace a text prompt only once the engine's tokenizer is known to agree with the gateway's
(``EngineState.tokenizer_agrees``): an id sequence from another tokenizer would be a different prompt.
"""

from __future__ import annotations

from typing import Any

from cache.tokens import pack_token_ids
from gateway.prepared import Prepared
from gateway.request_limits import EMBEDDINGS_PATH, RESPONSES_PATH
from region_map.config import EngineKind
from region_map.fleet import EngineState


def engine_body(
    p: Prepared,
    engine: EngineState,
    *,
    default_block_size: int,
    additions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The body for ``engine``; ``additions`` (transfer parameters, bootstrap fields) are merged last."""
    body = dict(p.body)
    kind = engine.kind
    if p.cache_salt and kind in (EngineKind.KVGATE, EngineKind.VLLM):
        body["cache_salt"] = p.cache_salt
    if p.path == EMBEDDINGS_PATH:  # (as the client wrote it: its inputs were counted, not hashed)
        return body
    if p.whole_prompt:  # (else its ids are the text of a prompt with media: the engine reads the client's)
        _send_the_ids(body, p, engine, default_block_size)
    xargs = body.get("vllm_xargs")
    if kind is EngineKind.VLLM and isinstance(xargs, dict) and "kv_cache_report_mode" in xargs:
        # "full" makes vLLM announce again blocks it served from cache, with no removals to match: the
        # residency index would keep blocks the engine has evicted.
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_cache_report_mode"}
    if p.stream and p.path != RESPONSES_PATH:  # always ask for usage: billing needs its cached_tokens
        # (A Responses stream always ends with its usage, and has no such option.)
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    if additions:
        body.update(additions)
    return body


def _send_the_ids(body: dict[str, Any], p: Prepared, engine: EngineState, default_block_size: int) -> None:
    """The gateway's token ids in ``body``, where the engine takes them in place of the prompt's text."""
    if engine.kind is EngineKind.KVGATE:
        # (A continued Responses conversation starts with history only its engine holds: the gateway's
        # ids are its new input alone, not its prompt.)
        if engine.token_ids_on(p.path) and p.previous_response_id is None:
            if engine.packed_token_ids:  # hex digits: an engine reads them 5x faster than JSON numbers
                body["prompt_token_ids_hex"] = pack_token_ids(p.token_ids)
            else:
                body["prompt_token_ids"] = p.token_ids
            if p.shared_tokens:
                body["cache_shared_blocks"] = p.shared_tokens // (engine.block_size or default_block_size)
    elif engine.token_ids_on(p.path) and _ids_are_the_prompt(p, engine):
        body["prompt"] = p.token_ids


def _ids_are_the_prompt(p: Prepared, engine: EngineState) -> bool:
    """Whether sending the gateway's ids in place of the client's prompt keeps the prompt the same: the
    client sent ids itself, or the engine's tokenizer was checked against the gateway's."""
    prompt = p.body.get("prompt")
    client_sent_ids = isinstance(prompt, list) and not (prompt and isinstance(prompt[0], str))
    return client_sent_ids or engine.tokenizer_agrees is True


def prefill_only(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request reduced to its prefill, as vLLM's P/D proxies send it to a prefill engine: one
    token, whole (not streamed). The K/V it leaves behind is what the decode engine takes."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    return out
