"""The circuit breaker's states: closed, open for a cool-down, one half-open trial, doubling cool-downs."""

from __future__ import annotations

from region_map.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_closes_after_a_good_trial() -> None:
    clock = Clock()
    b = CircuitBreaker(failures=3, cooldown_s=5.0, clock=clock)
    b.on_failure()
    b.on_failure()
    b.on_success()  # a success resets the streak
    b.on_failure()
    b.on_failure()
    assert b.allows() and b.state is BreakerState.CLOSED
    b.on_failure()
    assert b.state is BreakerState.OPEN and not b.allows()
    clock.now = 4.9
    assert not b.allows()
    clock.now = 5.0
    assert b.allows()
    b.on_dispatch()  # the half-open trial
    assert b.state is BreakerState.HALF_OPEN and not b.allows()  # one trial at a time
    b.on_success()
    assert b.state is BreakerState.CLOSED and b.allows() and b.opened == 1


def test_a_failed_trial_doubles_the_cooldown_up_to_the_cap() -> None:
    clock = Clock()
    b = CircuitBreaker(failures=1, cooldown_s=2.0, max_cooldown_s=5.0, clock=clock)
    b.on_failure()
    for cooldown in (4.0, 5.0, 5.0):
        clock.now += 2.0 if cooldown == 4.0 else 0.0
        while not b.allows():
            clock.now += 0.5
        b.on_dispatch()
        b.on_failure()
        opened_at = clock.now
        assert b.state is BreakerState.OPEN
        clock.now = opened_at + cooldown - 0.01
        assert not b.allows()
        clock.now = opened_at + cooldown
        assert b.allows()


def test_an_abandoned_trial_frees_the_slot() -> None:
    clock = Clock()
    b = CircuitBreaker(failures=1, cooldown_s=1.0, clock=clock)
    b.on_failure()
    clock.now = 1.0
    b.on_dispatch()
    assert not b.allows()
    b.on_abandon()  # the client left before the engine said anything
    assert b.allows() and b.state is BreakerState.HALF_OPEN


def test_a_hold_skips_the_engine_for_its_retry_after_capped_and_leaves_the_cooldown_alone() -> None:
    clock = Clock()
    b = CircuitBreaker(failures=3, cooldown_s=2.0, max_cooldown_s=60.0, clock=clock)
    b.hold(30.0)
    assert b.state is BreakerState.OPEN and not b.allows()
    b.hold(1.0)  # a shorter hold does not shorten the longer one
    clock.now = 29.9
    assert not b.allows()
    clock.now = 30.0
    assert b.allows()
    b.on_dispatch()  # a trial, as after any cool-down
    b.on_failure()
    clock.now += 4.0  # a failed trial after a hold doubles the breaker's own cool-down, not the hold
    assert b.allows()
    b.hold(1e9)
    clock.now += 60.0
    assert b.allows()  # capped at max_cooldown_s
