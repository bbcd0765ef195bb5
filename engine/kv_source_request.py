"""The body of a request for K/V: what a receiving engine sends to ``/v1/kv/prefill`` or ``/v1/kv/cached``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from engine.openai_errors import OpenAIError
from engine.openai_params import int_param, token_ids_param


@dataclass(frozen=True, slots=True)
class KvSourceRequest:
    """What an engine that sends K/V is asked for: ``KvImporter``'s body to ``/v1/kv/prefill`` (compute and
    send) and ``/v1/kv/cached`` (send what the prefix cache holds), in the kvgate and the simulated engine."""

    prompt_token_ids: np.ndarray  # uint32
    from_position: int  # the first position to send: the receiver holds the ones before
    cache_salt: str
    cache_shared_blocks: int


def kv_source_body(
    *,
    model: str,
    block_size: int,
    request_id: str,
    prompt_token_ids: list[int],
    from_position: int,
    cache_salt: str,
    cache_shared_blocks: int,
) -> dict[str, Any]:
    """The body ``parse_kv_source_request`` reads: what a receiving engine (kvgate's, or a simulated one
    pulling) sends to ``/v1/kv/prefill`` or ``/v1/kv/cached``."""
    return {"model": model, "prompt_token_ids": prompt_token_ids, "cache_salt": cache_salt,
            "cache_shared_blocks": cache_shared_blocks, "from_position": from_position,
            "block_size": block_size, "request_id": request_id}  # fmt: skip


def parse_kv_source_request(
    raw: bytes, *, served_model: str, block_size: int, max_model_len: int
) -> KvSourceRequest:
    """The request, checked; a prompt longer than ``max_model_len`` (no engine computed or cached K/V for
    it) is refused before its ids are converted or hashed, work that would hold up the event loop."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise OpenAIError("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise OpenAIError("the body must be a JSON object")
    if body.get("model") != served_model:
        raise OpenAIError(
            f"the model '{body.get('model')}' does not exist; this engine serves '{served_model}'",
            status=404, param="model", code="model_not_found",
        )  # fmt: skip
    if body.get("block_size") != block_size:
        raise OpenAIError(f"block_size must be {block_size}", param="block_size")
    raw_ids = body.get("prompt_token_ids")
    if isinstance(raw_ids, list) and len(raw_ids) > max_model_len:
        raise OpenAIError(
            f"prompt_token_ids holds {len(raw_ids)} tokens, more than this engine's context of "
            f"{max_model_len} tokens",
            param="prompt_token_ids", code="context_length_exceeded",
        )  # fmt: skip
    ids = token_ids_param(raw_ids, "prompt_token_ids")
    if not len(ids):
        raise OpenAIError("prompt_token_ids must not be empty", param="prompt_token_ids")
    start = int_param(body.get("from_position"), "from_position", lo=0)
    if start >= len(ids):
        raise OpenAIError(f"from_position must lie in [0, {len(ids)})", param="from_position")
    salt = body.get("cache_salt") or ""
    if not isinstance(salt, str):
        raise OpenAIError("cache_salt must be a string", param="cache_salt")
    shared = int_param(body.get("cache_shared_blocks") or 0, "cache_shared_blocks", lo=0)
    return KvSourceRequest(ids, start, salt, shared)
