"""The simulated engine's configuration (:class:`SimEngineConfig`), re-exported by ``engine.sim.server``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.kv_publisher import DEFAULT_HEARTBEAT_S
from perfmodel.profiles import EngineProfile, parse_overrides, profile, with_overrides


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    """Everything that shapes the simulator; costs in seconds per token.

    ``profile``: the name of a ``perfmodel`` engine profile (``llama3-8b-h100``, ...) switches on the
    batching mode (``engine/sim/batching_loop.py``): requests then share one step loop whose step times,
    token budget, running cap and KV capacity are the profile's, and ``prefill_s_per_token``,
    ``decode_s_per_token`` and ``max_running`` are not used. ``profile_overrides`` (``"field=value,..."``,
    only with a profile) replaces some of the profile's constants. Without a profile every request is
    costed on its own, as it always was.
    """

    engine_id: str
    model: str = "kvgate-sim"
    block_size: int = 16
    capacity_blocks: int = 4096
    prefill_s_per_token: float = 5e-5
    decode_s_per_token: float = 0.02
    max_running: int = 64
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    max_model_len: int = 131072  # prompt + max_tokens; bounds the work one request can ask for
    kv_heartbeat_s: float = DEFAULT_HEARTBEAT_S
    kv_pull_s_per_token: float = 1.2e-5  # sending cached K/V to a peer that pulls it (engine/sim/kv_pull.py)
    tokenizer: str | None = None  # a Hugging Face tokenizer directory; None: the byte-level tokenizer
    profile: str | None = None  # a perfmodel profile name: the batching mode; None: per-request costs
    profile_overrides: str = ""  # "field=value,..." applied to the profile

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine_id must not be empty")
        if self.block_size < 1 or self.max_running < 1 or self.max_model_len < 2:
            raise ValueError("block_size and max_running must be >= 1, max_model_len >= 2")
        if self.capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        costs = (self.prefill_s_per_token, self.decode_s_per_token, self.kv_pull_s_per_token)
        # NaN passed ``< 0`` and slept no time at all; inf held every request forever.
        if not all(0 <= cost < math.inf for cost in costs):
            raise ValueError("costs must be finite numbers >= 0")
        if not 0 <= self.port <= 65535:
            raise ValueError("port must lie in [0, 65535]")
        if self.profile is None and self.profile_overrides.strip():
            raise ValueError("profile_overrides needs a profile")
        self.engine_profile()  # an unknown profile or a bad override fails here, not at the first request

    def engine_profile(self) -> EngineProfile | None:
        """The batching mode's profile with its overrides applied; ``None`` without a profile."""
        if self.profile is None:
            return None
        return with_overrides(profile(self.profile), **parse_overrides(self.profile_overrides))
