"""The routing knobs (the ``[gateway.routing]`` table), apart from the request path's types in
``gateway.routing.base``: a pydantic model, which the compiled hot path (``gateway.compiled``) leaves to
Python."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RoutingSettings(BaseModel):
    """Knobs shared by the policies (the ``[gateway.routing]`` table)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = Field(
        default="default", description="default | cache_aware | session | least_load | round_robin"
    )
    prefill_s_per_token: float = Field(default=5e-5, ge=0, description="estimated cost of one uncached token")
    # The next three are in prefill tokens (of prefill_s_per_token each), not seconds, so that one table
    # suits an 8B engine and a 70B one alike: a margin that matters is a fraction of a prompt's prefill,
    # whatever the engine's speed.
    load_penalty_tokens: float = Field(
        default=40.0, ge=0, description="estimated delay per request already running, in prefill tokens"
    )
    max_waiting: int = Field(
        default=8,
        ge=1,
        description="load guard: an engine with this many queued requests is overloaded, unless its report "
        "shows they wait only for prefill budget (a free slot, free KV for its queued prompt tokens)",
    )
    tie_tolerance_tokens: float = Field(
        default=20.0, ge=0, description="estimates this close (in prefill tokens) are a tie"
    )
    tie_tolerance_frac: float = Field(
        default=0.05,
        ge=0,
        description="... or this close relative to the best: then home, load and hashing decide",
    )
    session_slack_tokens: float = Field(
        default=1000.0,
        ge=0,
        description="a session moves only if another engine is faster by this many prefill tokens' time",
    )
    session_slack_frac: float = Field(
        default=1.0,
        ge=0,
        description="... and faster by this many times the prefill its cached prefix would cost elsewhere",
    )
    # A move that recomputes the session's prefix adds that work to the other engine's queue, and in a busy
    # fleet it delays every request queued there after it: about as many as wait there now (in a steady
    # queue, as many arrive during a wait as were queued ahead). Charging the move for them keeps sessions
    # on their cache when every queue is long, which a per-request estimate alone does not
    # (tests/bench/bench_overload.py).
    session_slack_frac_per_waiting: float = Field(
        default=1.0,
        ge=0,
        description="... plus this many times more per request waiting on the other engine",
    )
    # The same three in seconds, as earlier releases took them: when given, a figure overrides the
    # token one. A fixed time suits one engine speed only; the token figures are preferred.
    load_penalty_s: float | None = Field(default=None, ge=0, description="load_penalty_tokens in seconds")
    tie_tolerance_s: float | None = Field(default=None, ge=0, description="tie_tolerance_tokens in seconds")
    session_slack_s: float | None = Field(default=None, ge=0, description="session_slack_tokens in seconds")
    max_remote_share: float = Field(
        default=0.2, ge=0, le=1, description="the most of a home region's recent traffic served elsewhere"
    )
    kv_pull: bool = Field(
        default=True,
        description="default policy: an engine may pull a prefix its region's peer holds, not recompute it",
    )
    kv_pull_s_per_token: float = Field(
        default=1.2e-5,
        ge=0,
        description="estimated cost of pulling one token's K/V from a peer engine in the same region",
    )
    kv_pull_min_tokens: int = Field(
        default=512,
        ge=0,
        description="a peer's prefix is pulled only when it holds at least this many more tokens",
    )
    local_prefill_max_tokens: int = Field(
        default=256,
        ge=0,
        description="disaggregation: a decode engine prefills at most this many uncached tokens itself",
    )

    def seconds(self, tokens: float, override_s: float | None) -> float:
        """``tokens`` of prefill in seconds, or ``override_s`` when the configuration gave seconds."""
        return tokens * self.prefill_s_per_token if override_s is None else override_s

    @property
    def load_penalty(self) -> float:
        """Seconds per request already running on an engine (``load_penalty_tokens``)."""
        return self.seconds(self.load_penalty_tokens, self.load_penalty_s)

    @property
    def tie_tolerance(self) -> float:
        """Seconds within which two estimates tie (``tie_tolerance_tokens``)."""
        return self.seconds(self.tie_tolerance_tokens, self.tie_tolerance_s)

    @property
    def session_slack(self) -> float:
        """Seconds another engine must save before a session moves (``session_slack_tokens``)."""
        return self.seconds(self.session_slack_tokens, self.session_slack_s)
