"""Type-checked reads of single fields of an OpenAI request body (token ids, numbers, flags, stop strings).

Each returns the field's value or raises :class:`~engine.openai_errors.OpenAIError` naming the field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cache.tokens import uint32_array
from engine.openai_errors import OpenAIError

MAX_STOP_STRINGS = 4

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
