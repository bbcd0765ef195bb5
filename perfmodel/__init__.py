"""The cost model of a batching LLM engine: named, calibrated profiles and a deterministic step loop.

Shared by the simulated engine (``engine/sim``) and the trace simulator (``kvgate simulate``), which must
give the same step times for the same batch, so both call the same pure functions here. This package
imports nothing of the project (``engine`` and ``gateway`` never import each other).

Tokens are tokens: every count here is in the model's tokens, never characters or words.
"""

from perfmodel.batching import (
    BatchingEngine,
    RequestResult,
    StepRecord,
    kv_tokens_needed,
    prefill_throughput_tokens_per_s,
    step_time_s,
)
from perfmodel.profiles import (
    PROFILES,
    EngineProfile,
    parse_overrides,
    profile,
    profile_names,
    with_overrides,
)

__all__ = [
    "PROFILES",
    "BatchingEngine",
    "EngineProfile",
    "RequestResult",
    "StepRecord",
    "kv_tokens_needed",
    "parse_overrides",
    "prefill_throughput_tokens_per_s",
    "profile",
    "profile_names",
    "step_time_s",
    "with_overrides",
]
