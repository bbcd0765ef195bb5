"""``POST /v1/embeddings`` as vLLM 0.32 serves it for a causal LM run as an embedding model (``--runner
pooling --convert embed``): the request and the answer, shared by kvgate's engine and the simulated one.

vLLM's behaviour kept here (vllm/entrypoints/pooling/embed and base/protocol.py, renderers/params.py):

- ``input``: a string, an array of strings, an array of token ids or an array of arrays of them, one
  embedding each, in order. A text gets the tokenizer's special tokens (Llama's BOS) unless
  ``add_special_tokens`` is false; token ids are taken as they are.
- ``truncate_prompt_tokens``: -1 is the model's context length; N keeps the FIRST N tokens, as vLLM's
  tokenizers for the pooling runner truncate on the right by default (``truncation_side`` "left" keeps the
  last N). More than the context length is refused, as is a prompt left longer than the context.
- ``encoding_format``: "float" (the default) or "base64" (the float32 values' bytes, little-endian unless
  ``endianness`` says otherwise: the OpenAI SDK asks for base64 and decodes it); vLLM's binary "bytes" and
  "bytes_only" are refused. ``dimensions`` is refused with vLLM's message: the model has no Matryoshka
  dimensions. ``use_activation`` false skips the normalisation; ``normalize`` was removed (as in vLLM).
- ``usage``: prompt tokens (after special tokens and truncation) summed over the inputs; total the same.

- Chat forms (``messages``, or ``input``, as one conversation or an array of them): each conversation is
  rendered by the chat template without a generation prompt (``engine.embedding_chat``), its special tokens
  added only when ``add_special_tokens`` is true, then truncated as any input is.
"""

from __future__ import annotations

import base64
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import orjson

from cache.tokens import Tokenizer
from engine.embedding_chat import chat_conversations, render_conversations
from engine.openai_api import check_model, load_body, new_id
from engine.openai_errors import OpenAIError
from engine.openai_params import bool_param, int_param, token_ids_param

EMBEDDINGS_PATH = "/v1/embeddings"
EncodingFormat = Literal["float", "base64"]
ENCODING_FORMATS = ("float", "base64")
BINARY_FORMATS = ("bytes", "bytes_only")
INPUT_FORMS = (
    "a string, an array of strings, an array of token ids, an array of arrays of token ids, a conversation "
    "(an array of messages) or an array of conversations"
)
NORM_EPS = 1e-12  # torch.nn.functional.normalize's (vLLM's PoolerNormalize)
# vLLM's validate_cache_salt
MAX_CACHE_SALT = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """A validated ``/v1/embeddings`` request: the token ids of each input, as they will be embedded."""

    request_id: str  # the x-request-id
    response_id: str  # embd-<hex>
    model: str
    inputs: list[np.ndarray]  # uint32 token ids per input, after special tokens and truncation
    encoding_format: EncodingFormat = "float"
    little_endian: bool = True  # of base64's float32 bytes
    normalize: bool = True  # use_activation: L2-normalise (vLLM's default for embed)
    cache_salt: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_tokens(self) -> int:
        return sum(int(ids.shape[0]) for ids in self.inputs)


def parse_embedding_request(
    body: bytes | dict[str, Any],
    *,
    served_model: str,
    tokenizer: Tokenizer,
    request_id: str,
    max_model_len: int,
    vocab_size: int | None = None,
) -> EmbeddingRequest:
    """Validate a ``/v1/embeddings`` body; every client mistake is an :class:`OpenAIError` (4xx)."""
    data = body if isinstance(body, dict) else load_body(body)
    check_model(data, served_model)
    if "normalize" in data:
        message = "Parameter `normalize` was removed; use `use_activation` instead."
        raise OpenAIError(message, param="normalize")
    encoding_format = _encoding_format(data.get("encoding_format"))
    little_endian = _little_endian(data.get("endianness"))
    if data.get("embed_dtype") not in (None, "float32"):
        raise OpenAIError("embed_dtype must be 'float32' on this engine", param="embed_dtype")
    dimensions = data.get("dimensions")
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool):
            raise OpenAIError("dimensions must be an integer", param="dimensions")
        raise OpenAIError(  # vLLM's words (PoolingParams): the model was trained without Matryoshka
            f"Model {served_model!r} does not support Matryoshka embeddings; dimensions must be unset "
            f"(received dimensions={dimensions}).",
            param="dimensions",
        )
    _check_options(data)
    normalize = bool_param(data.get("use_activation"), "use_activation", default=True)
    keep, left = _truncation(data, max_model_len)
    cache_salt = _cache_salt(data.get("cache_salt"))

    chats = chat_conversations(data)
    if chats is not None:
        where = chats[0]
        prompts = render_conversations(data, where, chats[1], tokenizer)
    else:
        where = "input"
        add_special = bool_param(data.get("add_special_tokens"), "add_special_tokens", default=True)
        prompts = [
            tokenizer.with_special_tokens(ids) if is_text and add_special else ids
            for ids, is_text in _inputs(data.get("input"), tokenizer)
        ]
    inputs = []
    for ids in prompts:
        if vocab_size is not None and ids.shape[0] and (largest := int(ids.max())) >= vocab_size:
            message = f"{where} holds token id {largest}, outside the model's vocabulary of {vocab_size}"
            raise OpenAIError(message, param=where)
        if keep is not None and keep < ids.shape[0]:
            ids = ids[ids.shape[0] - keep :] if left else ids[:keep]
        if ids.shape[0] == 0:
            raise OpenAIError(f"{where} must not be empty (nor truncated to nothing)", param=where)
        if ids.shape[0] > max_model_len:
            raise OpenAIError(  # vLLM's words (TokenizeParams), the field and code as completions say them
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                f"contains {ids.shape[0]} input tokens, which exceeds this limit even without any output "
                "tokens. Please reduce the length of the input prompt.",
                param=where,
                code="context_length_exceeded",
            )
        inputs.append(ids)
    return EmbeddingRequest(
        request_id=request_id,
        response_id=new_id("embd-"),
        model=served_model,
        inputs=inputs,
        encoding_format=encoding_format,
        little_endian=little_endian,
        normalize=normalize,
        cache_salt=cache_salt,
    )


def _encoding_format(value: Any) -> EncodingFormat:
    if value is None or value == "float":
        return "float"
    if value == "base64":
        return "base64"
    if value in BINARY_FORMATS:
        raise OpenAIError(
            f"encoding_format {value!r} (a binary response) is not supported by this engine; "
            "use 'float' or 'base64'",
            param="encoding_format",
        )
    raise OpenAIError("encoding_format must be 'float' or 'base64'", param="encoding_format")


def _little_endian(value: Any) -> bool:
    if value is None or value == "native":  # (vLLM's default: the server's own byte order)
        return sys.byteorder == "little"
    if value in ("little", "big"):
        return bool(value == "little")
    raise OpenAIError("endianness must be 'native', 'little' or 'big'", param="endianness")


def _check_options(data: dict[str, Any]) -> None:
    """The fields vLLM takes that change nothing here, or that this engine cannot honour."""
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise OpenAIError("user must be a string", param="user")
    if data.get("padding") not in (None, "do_not_pad"):
        raise OpenAIError("padding must be 'do_not_pad' on this engine", param="padding")
    priority = data.get("priority")
    if priority is not None and int_param(priority, "priority") != 0:
        raise OpenAIError("priority scheduling is not enabled on this engine", param="priority")


def _truncation(data: dict[str, Any], max_model_len: int) -> tuple[int | None, bool]:
    """(tokens to keep or None, whether the last ones are kept) of ``truncate_prompt_tokens``."""
    side = data.get("truncation_side")
    if side not in (None, "left", "right"):
        raise OpenAIError("`truncation_side` must be either 'left' or 'right'.", param="truncation_side")
    raw = data.get("truncate_prompt_tokens")
    if raw is None:
        return None, False
    keep = int_param(raw, "truncate_prompt_tokens", lo=-1)
    if keep > max_model_len:
        raise OpenAIError(  # vLLM's words
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = {max_model_len}. "
            "Please request a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    return (max_model_len if keep == -1 else keep), side == "left"


def _cache_salt(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or not value:
        message = "Parameter 'cache_salt' must be a non-empty string if provided."
        raise OpenAIError(message, param="cache_salt")
    if len(value) > MAX_CACHE_SALT or any(c in CACHE_SALT_FORBIDDEN for c in value):
        raise OpenAIError(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', "
            "or NUL.",
            param="cache_salt",
        )
    return value


def _inputs(value: Any, tokenizer: Tokenizer) -> list[tuple[np.ndarray, bool]]:
    """(token ids, whether they came from a text) per input."""
    if value is None:
        raise OpenAIError("input is required", param="input")
    if isinstance(value, str):
        return [(_text(value, tokenizer), True)]
    if not isinstance(value, list):
        raise OpenAIError(f"input must be {INPUT_FORMS}", param="input")
    if not value:
        raise OpenAIError("input must not be empty", param="input")
    first = value[0]
    # Looking at the first element only keeps a long token-id input off a per-element Python loop;
    # token_ids_param checks every element in C.
    if isinstance(first, int):
        return [(token_ids_param(value, "input"), False)]
    if isinstance(first, str):
        if not all(isinstance(text, str) for text in value):
            raise OpenAIError(f"input must be {INPUT_FORMS}", param="input")
        return [(_text(text, tokenizer), True) for text in value]
    if isinstance(first, list):
        if not all(isinstance(ids, list) for ids in value):
            raise OpenAIError(f"input must be {INPUT_FORMS}", param="input")
        return [(token_ids_param(ids, "input"), False) for ids in value]
    raise OpenAIError(f"input must be {INPUT_FORMS}", param="input")


def _text(text: str, tokenizer: Tokenizer) -> np.ndarray:
    if not text:
        raise OpenAIError("input must not be empty", param="input")
    return tokenizer.encode(text)


# ---------------------------------------------------------------------------------------------- answer


def embeddings_body(req: EmbeddingRequest, vectors: list[np.ndarray]) -> bytes:
    """The 200 body, as vLLM's: ``{"id", "object": "list", "created", "model", "data": [{"index", "object":
    "embedding", "embedding"}], "usage": {"prompt_tokens", "total_tokens"}}``, one vector per input."""
    data = [
        {"index": i, "object": "embedding", "embedding": _encode(req, pooled(vector, req.normalize))}
        for i, vector in enumerate(vectors)
    ]
    tokens = req.prompt_tokens
    body = {
        "id": req.response_id,
        "object": "list",
        "created": req.created,
        "model": req.model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def pooled(hidden: np.ndarray, normalize: bool) -> np.ndarray:
    """A last hidden state as vLLM's embed head makes it: float32, L2-normalised unless asked not to."""
    vector = np.ascontiguousarray(hidden, dtype=np.float32)
    if not normalize:
        return vector
    norm = np.float32(np.linalg.norm(vector))
    out: np.ndarray = vector / max(norm, np.float32(NORM_EPS))
    return out


def _encode(req: EmbeddingRequest, vector: np.ndarray) -> np.ndarray | str:
    if req.encoding_format == "float":
        return vector  # (orjson writes a float32 array as the shortest decimals that read back the same)
    raw = vector.astype("<f4" if req.little_endian else ">f4").tobytes()
    return base64.b64encode(raw).decode("ascii")
