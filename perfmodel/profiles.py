"""Engine profiles: the constants of the step-time model, named after a model and a GPU, overridable.

A step of a batching engine (continuous batching, chunked prefill) takes

    step_fixed_s + prefill_s_per_token * prefill tokens + decode_s_per_seq * decoding sequences
                 + cached_read_s_per_token * cached tokens read

(``perfmodel.batching.step_time_s``). ``step_fixed_s`` is what every forward pass pays whatever its batch:
streaming the weights from HBM once (decode is memory-bound) plus launch/scheduling overhead.
``decode_s_per_seq`` is the extra per running sequence: reading its KV cache (taken at a mean context of
1024 tokens) plus sampling. Prefill is compute-bound: ``prefill_s_per_token`` ≈ 2·params FLOPs / achieved
FLOP/s. The model is linear on purpose: memory and compute overlap on a GPU (time ≈ max, not sum), and for
decode the memory side dominates at the batch sizes these profiles admit, so the sum of the memory terms is
the first-order answer; for prefill-heavy steps the prefill term dominates everything else.

How the named constants were obtained (hardware-derived; first-order, not fitted to a measured curve):

* Deployment shapes follow vLLM's v0.6.0 performance post (https://blog.vllm.ai/2024/09/05/perf-update.html):
  "Llama 8B on 1xH100 and 70B on 4xH100", i.e. Llama 3 8B unsharded and Llama 3 70B at tensor parallel 4.
* Achievable utilisations follow Databricks/MosaicML, "LLM Inference Performance Engineering: Best Practices"
  (https://www.databricks.com/blog/llm-inference-performance-engineering-best-practices), which measures
  decode by model bandwidth utilisation (MBU, 60-80 % achievable on A100/H100-class parts with good kernels)
  and notes tensor parallelism lowers it: we take 75 % MBU on one GPU, 70 % at TP4, and 55 % / 50 % MFU for
  prefill.
* H100 SXM 80 GB data sheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3.
* Scheduler knobs are vLLM's defaults: ``max_num_seqs`` 256, block size 16, ``gpu_memory_utilization`` 0.9,
  and a chunked-prefill token budget of 8192 (``max_num_batched_tokens``; vLLM's default for online serving
  on H100-class GPUs; older releases used 512-2048, pass an override to model those).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class EngineProfile:
    """The constants of one engine (a model on some GPUs), in seconds and tokens.

    ``max_batch_tokens`` is the token budget of one step (decode sequences take one token each, prefill
    chunks the rest); ``max_running`` caps the sequences in a batch; ``kv_capacity_tokens`` is the KV cache
    in tokens, allocated in blocks of ``block_size`` tokens.
    """

    step_fixed_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    max_batch_tokens: int
    max_running: int
    kv_capacity_tokens: int
    block_size: int = 16
    cached_read_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step_fixed_s", "prefill_s_per_token", "decode_s_per_seq", "cached_read_s_per_token"):
            value = getattr(self, name)
            # NaN passes ``< 0`` (a simulator's steps then took no time) and inf held every request forever.
            if not math.isfinite(value):
                raise ValueError(f"EngineProfile.{name} must be a finite number >= 0, got {value}")
            if value < 0:
                raise ValueError(f"EngineProfile.{name} must be >= 0, got {value}")
        for name in ("max_batch_tokens", "max_running", "kv_capacity_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineProfile.{name} must be >= 1, got {getattr(self, name)}")
        if self.step_fixed_s + self.prefill_s_per_token <= 0:
            raise ValueError(
                "EngineProfile: a prefill step must take time (step_fixed_s + prefill_s_per_token)"
            )


# Llama 3 8B (8.03e9 params, 32 layers, 8 KV heads x 128 dims, BF16) on 1x H100 SXM 80 GB.
#   prefill:  2 * 8.03e9 = 1.606e10 FLOP/token; 989e12 * 0.55 MFU = 5.44e14 FLOP/s
#             -> 1.606e10 / 5.44e14 = 2.95e-5 s/token, rounded to 3.0e-5 (≈ 33k prefill tokens/s)
#   fixed:    weights 16.06 GB / (3.35e12 * 0.75 MBU = 2.51e12 B/s) = 6.4 ms, + ~0.6 ms launch, scheduling
#             and sampling with CUDA graphs -> 7.0 ms (so a lone sequence decodes at ≈ 141 tokens/s)
#   per seq:  KV per token 2 (K,V) * 32 layers * 8 heads * 128 dims * 2 B = 131072 B; at a 1024-token mean
#             context 1.34e8 B / 2.51e12 B/s = 53 µs, + ~7 µs per-sequence work -> 6.0e-5 s
#   cached:   one cached token's KV read once by the prefill that reuses it: 131072 / 2.51e12 = 5.2e-8 s
#   KV:       80 GB * 0.9 = 72 GB - 16.06 GB weights - ~4 GB activations/CUDA graphs = 51.94 GB
#             / 131072 B = 396270 tokens, floored to whole 16-token blocks -> 396256
LLAMA3_8B_H100 = EngineProfile(
    step_fixed_s=7.0e-3,
    prefill_s_per_token=3.0e-5,
    decode_s_per_seq=6.0e-5,
    cached_read_s_per_token=5.2e-8,
    max_batch_tokens=8192,
    max_running=256,
    kv_capacity_tokens=396_256,
    block_size=16,
)

# Llama 3 70B (70.6e9 params, 80 layers, 8 KV heads x 128 dims, BF16) on 4x H100 SXM 80 GB, tensor parallel 4.
#   prefill:  2 * 70.6e9 = 1.412e11 FLOP/token; 4 * 989e12 * 0.50 MFU (TP all-reduces) = 1.978e15 FLOP/s
#             -> 7.14e-5 s/token, rounded to 7.1e-5 (≈ 14k prefill tokens/s for the 4-GPU engine)
#   fixed:    weights 141.2 GB / (4 * 3.35e12 * 0.70 MBU = 9.38e12 B/s) = 15.1 ms, + 2 all-reduces per layer
#             (160 at ~10 µs ≈ 1.6 ms) and launch overhead -> 17 ms (a lone sequence: ≈ 59 tokens/s)
#   per seq:  KV per token 2 * 80 * 8 * 128 * 2 B = 327680 B; at a 1024-token mean context
#             3.36e8 B / 9.38e12 B/s = 36 µs, + ~4 µs per-sequence work -> 4.0e-5 s
#   cached:   327680 / 9.38e12 = 3.5e-8 s per cached token read
#   KV:       4 * 80 GB * 0.9 = 288 GB - 141.2 GB weights - 4 * ~4 GB activations = 130.8 GB
#             / 327680 B = 399170 tokens, floored to whole 16-token blocks -> 399168
LLAMA3_70B_H100_TP4 = EngineProfile(
    step_fixed_s=1.7e-2,
    prefill_s_per_token=7.1e-5,
    decode_s_per_seq=4.0e-5,
    cached_read_s_per_token=3.5e-8,
    max_batch_tokens=8192,
    max_running=256,
    kv_capacity_tokens=399_168,
    block_size=16,
)

PROFILES: MappingProxyType[str, EngineProfile] = MappingProxyType(
    {
        "llama3-8b-h100": LLAMA3_8B_H100,
        "llama3-70b-h100": LLAMA3_70B_H100_TP4,  # tensor parallel 4: one engine spans 4 GPUs
        "llama3-70b-h100-tp4": LLAMA3_70B_H100_TP4,
    }
)
"""The named profiles, by the name a CLI takes (``--profile llama3-8b-h100``)."""


def profile_names() -> list[str]:
    """The names ``profile`` accepts, sorted."""
    return sorted(PROFILES)


def profile(name: str) -> EngineProfile:
    """The named profile; a ``ValueError`` listing the known names if there is none by that name."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown engine profile {name!r}; known: {', '.join(profile_names())}") from None


_FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(EngineProfile)}


def with_overrides(base: EngineProfile, **fields: float) -> EngineProfile:
    """``base`` with the given fields replaced (validated again); a ``ValueError`` for an unknown field."""
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown EngineProfile field(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
    coerced: dict[str, Any] = {}  # each value of its field's type, checked here
    for key, value in fields.items():
        if _FIELDS[key].type == "int":
            if not math.isfinite(value):  # int() of it raised an OverflowError: a traceback for a CLI
                raise ValueError(f"EngineProfile.{key} must be a finite number, got {value!r}")
            if float(value) != int(value):
                raise ValueError(f"EngineProfile.{key} takes an integer, got {value!r}")
            coerced[key] = int(value)
        else:
            coerced[key] = float(value)
    return dataclasses.replace(base, **coerced)


def parse_overrides(text: str) -> dict[str, float]:
    """``"step_fixed_s=0.004,max_running=128"`` -> ``{"step_fixed_s": 0.004, "max_running": 128.0}``.

    For CLIs (pass the result to ``with_overrides``, which checks integer fields). Blank text gives ``{}``;
    an unknown field, a missing ``=`` or a value that is not a number raise ``ValueError``.
    """
    out: dict[str, float] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"profile override {item!r} is not FIELD=VALUE")
        if key not in _FIELDS:
            raise ValueError(f"unknown EngineProfile field {key!r}; known: {', '.join(_FIELDS)}")
        try:
            out[key] = float(value.strip())
        except ValueError:
            raise ValueError(f"profile override {item!r}: {value.strip()!r} is not a number") from None
    return out
