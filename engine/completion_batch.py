"""A ``/v1/completions`` body naming several prompts (``prompt: ["a", "b"]`` or ``[[1, 2], [3, 4]]``, OpenAI's
and vLLM's batch form), read as one :class:`GenerationRequest` per prompt.

vLLM serves such a body as a request per prompt (its ids the client's with ``-<prompt index>``) and joins
their answers into one (``engine.batch_serve``). Every prompt is validated before any is started: the first
that fails fails the whole request, its error prefixed with the prompt's index where the prompt is at fault.
A body with one prompt (a string, token ids, or a one-element list) is read exactly as before.
"""

from __future__ import annotations

from typing import Any

from cache.tokens import Tokenizer
from engine.openai_api import GenerationRequest, RequestKind, load_body, parse_request
from engine.openai_errors import OpenAIError
from engine.openai_params import PACKED_IDS_FIELD
from engine.openai_sampling import PLAIN, Capabilities

MAX_PROMPTS = 128  # prompts in one request (the gateway's bound too)
# Sequences one request may make (prompts x n): each holds its own copy of its prompt's ids, so 128 prompts at
# n = 128 would make 16,384 copies of 2 MB of text's worth of prompts from one request.
MAX_SEQUENCES = 1024
_FORMS = (
    "prompt must be a string, an array of strings, an array of token ids, or an array of arrays of token ids"
)


def parse_requests(
    body: bytes | dict[str, Any],
    kind: RequestKind,
    *,
    served_model: str,
    tokenizer: Tokenizer,
    request_id: str,
    max_model_len: int | None = None,
    capabilities: Capabilities = PLAIN,
    vocab_size: int | None = None,
    max_prompts: int = MAX_PROMPTS,
) -> list[GenerationRequest]:
    """The requests of a body: one for a chat or a completion of a single prompt (``parse_request``'s,
    unchanged); one per prompt for a completion naming several, sharing the batch's response id and
    creation time, each ``request_id`` with ``-<prompt index>`` (as vLLM names them). :class:`OpenAIError`
    for the first thing wrong with any of them."""
    data = body if isinstance(body, dict) else load_body(body)
    prompts = _batch_prompts(data, max_prompts) if kind == "completion" else None

    def parse(prompt_data: dict[str, Any], rid: str) -> GenerationRequest:
        return parse_request(
            prompt_data,
            kind,
            served_model=served_model,
            tokenizer=tokenizer,
            request_id=rid,
            max_model_len=max_model_len,
            capabilities=capabilities,
            vocab_size=vocab_size,
        )

    if prompts is None:
        return [parse(data, request_id)]
    if data.get("kv_transfer_params") is not None:
        # (Its K/V source holds one prompt: the gateway sends a batch's prompts one by one.)
        message = "kv_transfer_params applies to one prompt; send a batch's prompts as requests of their own"
        raise OpenAIError(message, param="kv_transfer_params")
    n = data.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n * len(prompts) > MAX_SEQUENCES:
        raise OpenAIError(
            f"{len(prompts)} prompts with n = {n} make {n * len(prompts)} sequences; this engine makes at "
            f"most {MAX_SEQUENCES} for one request",
            param="n",
        )
    reqs: list[GenerationRequest] = []
    for i, prompt in enumerate(prompts):
        # A one-element list: a text gets its special tokens as a single text prompt does; a list of ids is
        # read as token ids (never as a nested prompt).
        try:
            req = parse({**data, "prompt": [prompt]}, f"{request_id}-{i}")
        except OpenAIError as exc:
            if exc.param == "prompt" or exc.code == "context_length_exceeded":
                exc = OpenAIError(
                    f"prompt {i}: {exc.message}", status=exc.status, param=exc.param, code=exc.code
                )
            raise exc from None
        if reqs:
            req.response_id, req.created = reqs[0].response_id, reqs[0].created
        reqs.append(req)
    return reqs


def _batch_prompts(data: dict[str, Any], max_prompts: int) -> list[Any] | None:
    """The prompts of a batch (two or more: strings, or lists of token ids, not mixed), or None for a body of
    one prompt, which ``parse_request`` reads (and refuses, if it is wrong)."""
    prompt = data.get("prompt")
    if data.get(PACKED_IDS_FIELD) is not None or data.get("prompt_token_ids") is not None:
        return None  # (the gateway's tokenized prompt: one, which wins over ``prompt``)
    if not isinstance(prompt, list) or len(prompt) < 2 or isinstance(prompt[0], int):
        return None
    if len(prompt) > max_prompts:
        raise OpenAIError(
            f"prompt holds {len(prompt)} prompts; this engine takes at most {max_prompts} per request",
            param="prompt",
        )
    if isinstance(prompt[0], str):
        if not all(isinstance(p, str) for p in prompt):
            raise OpenAIError(_FORMS, param="prompt")
    elif not all(isinstance(p, list) for p in prompt):
        raise OpenAIError(_FORMS, param="prompt")
    return prompt
