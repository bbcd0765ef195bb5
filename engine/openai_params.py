"""Type-checked reads of single fields of an OpenAI request body (token ids, numbers, flags, stop strings).

Each returns the field's value or raises :class:`~engine.openai_errors.OpenAIError` naming the field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cache.tokens import uint32_array
from engine.openai_errors import OpenAIError

MAX_STOP_STRINGS = 4
MAX_TOKEN_ID_ENTRIES = 1024  # logit_bias entries, stop_token_ids: bounds each request's work per step
MAX_LOGIT_BIAS = 100.0

# The prompt's ids packed by ``cache.tokens.pack_token_ids``: what kvgate's gateway sends engines that report
# ``"token_ids_hex": true`` on /health. JSON numbers cost an engine about 25 ns per id to read (a 100k-token
# prompt stalls its event loop for 2.5 ms), hex digits about 6 (tests/bench/bench_token_ids.py).
PACKED_IDS_FIELD = "prompt_token_ids_hex"


def unpack_token_ids(value: Any) -> np.ndarray:
    """``prompt_token_ids_hex`` as uint32 ids; anything but 8 hex digits per id is the client's error."""
    if not isinstance(value, str):
        raise OpenAIError(f"{PACKED_IDS_FIELD} must be a string of hex digits", param=PACKED_IDS_FIELD)
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise OpenAIError(f"{PACKED_IDS_FIELD} must hold only hex digits", param=PACKED_IDS_FIELD) from None
    if len(raw) % 4:
        raise OpenAIError(f"{PACKED_IDS_FIELD} must hold 8 hex digits per token id", param=PACKED_IDS_FIELD)
    return np.frombuffer(raw, dtype=">u4").astype(np.uint32)


def token_ids_param(value: Any, param: str) -> np.ndarray:
    """A list of token ids as uint32, checked in C (prompts can be 100k long: this takes a quarter of the
    time ``np.asarray`` did, tests/bench/bench_token_ids.py)."""
    if not isinstance(value, list):
        raise OpenAIError(f"{param} must be an array of token ids", param=param)
    if not value:
        return np.empty(0, dtype=np.uint32)
    try:
        ids = uint32_array(value)
    except TypeError:
        raise OpenAIError(f"{param} must be an array of integers", param=param) from None
    except OverflowError:
        raise OpenAIError(f"{param} must lie in [0, 2**32)", param=param) from None
    # JSON true/false arrive as bools, which are ints to Python: an array of nothing else is no prompt.
    if int(ids.max()) <= 1 and all(type(v) is bool for v in value):
        raise OpenAIError(f"{param} must be an array of integers", param=param)
    return ids


def int_param(value: Any, param: str, *, lo: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise OpenAIError(f"{param} must be an integer", param=param)
    if lo is not None and value < lo:
        raise OpenAIError(f"{param} must be >= {lo}", param=param)
    return value


def number_param(
    value: Any, param: str, *, lo: float, hi: float, default: float, lo_open: bool = False
) -> float:
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise OpenAIError(f"{param} must be a number", param=param)
    if value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise OpenAIError(f"{param} must lie in {bracket}{lo:g}, {hi:g}]", param=param)
    return float(value)


def bool_param(value: Any, param: str, *, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"{param} must be a boolean", param=param)
    return value


def stop_param(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise OpenAIError("stop must be a string or an array of strings", param="stop")
    if len(value) > MAX_STOP_STRINGS:
        raise OpenAIError(f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop")
    # An empty stop string would match before the first token; it cannot be what the client meant.
    return tuple(s for s in value if s)


def logit_bias_param(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object mapping token ids (as strings) to a bias in [-100, 100]."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise OpenAIError("logit_bias must be an object mapping token ids to numbers", param="logit_bias")
    if len(value) > MAX_TOKEN_ID_ENTRIES:
        raise OpenAIError(f"logit_bias takes at most {MAX_TOKEN_ID_ENTRIES} entries", param="logit_bias")
    out = []
    for key, bias in value.items():
        # JSON object keys are strings; int() alone would also take " 7", "+7" and "7_0".
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise OpenAIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise OpenAIError(
                f"logit_bias token id {token} is outside the model's vocabulary of {vocab_size}",
                param="logit_bias",
            )
        if not isinstance(bias, int | float) or isinstance(bias, bool):
            raise OpenAIError(f"logit_bias[{key}] must be a number", param="logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise OpenAIError(f"logit_bias values must lie in [-100, 100], got {bias}", param="logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


def token_id_list_param(value: Any, param: str, vocab_size: int | None) -> tuple[int, ...]:
    """A short list of token ids (e.g. vLLM's ``stop_token_ids``), each within the vocabulary if known."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise OpenAIError(f"{param} must be an array of token ids", param=param)
    if len(value) > MAX_TOKEN_ID_ENTRIES:
        raise OpenAIError(f"{param} takes at most {MAX_TOKEN_ID_ENTRIES} token ids", param=param)
    if vocab_size is not None and value and max(value) >= vocab_size:
        raise OpenAIError(
            f"{param} holds token id {max(value)}, outside the model's vocabulary of {vocab_size}",
            param=param,
        )
    return tuple(value)
