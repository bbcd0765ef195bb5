"""A circuit breaker per engine: after ``failures`` consecutive request failures (refused, timed out, a 5xx
before any answer) the engine is skipped for ``cooldown_s``; then one trial request may go through
(half-open), and its outcome closes the breaker or opens it again for twice as long (at most
``max_cooldown_s``). An engine that says it is too busy with a ``Retry-After`` is skipped that long
(``hold``), then tried again the same way.

Health polling and breakers are complementary: a polled ``/health`` catches an engine that is down, the
breaker an engine whose health endpoint answers while its requests fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        *,
        failures: int = 3,
        cooldown_s: float = 5.0,
        max_cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self._streak = 0
        self._open_until = 0.0  # (monotonic) when an open breaker lets a trial through
        self._current_cooldown = cooldown_s
        self._trial_in_flight = False
        self.state = BreakerState.CLOSED
        self.opened = 0  # times it opened: a metric

    def allows(self) -> bool:
        """Whether a request may go there now (a read: routing calls it for every candidate)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return self._clock() >= self._open_until
        return not self._trial_in_flight

    def reopens_in(self) -> float:
        """Seconds until it lets a request through again: 0 when it does now; for one half-open with its
        trial under way, unknown (the trial's outcome decides): 0 too."""
        if self.state is BreakerState.OPEN:
            return max(0.0, self._open_until - self._clock())
        return 0.0

    def on_dispatch(self) -> None:
        """A request is going there: after the cool-down it is the half-open trial."""
        if self.state is BreakerState.OPEN and self._clock() >= self._open_until:
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def on_success(self) -> None:
        self._streak = 0
        self._trial_in_flight = False
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.CLOSED
            self._current_cooldown = self.cooldown_s

    def on_abandon(self) -> None:
        """The request ended with no verdict on the engine (the client left): free the trial slot."""
        self._trial_in_flight = False

    def on_failure(self) -> None:
        self._streak += 1
        self._trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN:
            self._open(min(self._current_cooldown * 2, self.max_cooldown_s))
        elif self.state is BreakerState.CLOSED and self._streak >= self.failures:
            self._open(self.cooldown_s)

    def hold(self, seconds: float) -> None:
        """The engine asked for no requests for ``seconds`` (a 429 or 503 with ``Retry-After``): skip it that
        long (at most ``max_cooldown_s``: a bogus figure must not shut an engine out for good), then let one
        trial through as after a cool-down. A busy engine is not a broken one: the failure streak and the
        cool-down that doubles after failed trials are left as they are."""
        self._trial_in_flight = False
        until = self._clock() + min(max(seconds, 0.0), self.max_cooldown_s)
        if self.state is BreakerState.OPEN and self._open_until >= until:
            return
        if self.state is not BreakerState.OPEN:
            self.opened += 1
        self.state = BreakerState.OPEN
        self._open_until = until

    def _open(self, cooldown_s: float) -> None:
        self.state = BreakerState.OPEN
        self._open_until = self._clock() + cooldown_s
        self._current_cooldown = cooldown_s
        self.opened += 1
