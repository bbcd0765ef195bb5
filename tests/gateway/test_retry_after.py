"""The waits the gateway writes: ``Retry-After`` in whole seconds and ``retry-after-ms`` beside it.

The OpenAI Python SDK reads ``retry-after-ms`` first, then ``Retry-After``: the milliseconds give it the
exact wait where whole seconds would round a 200 ms wait up to a second.
"""

from __future__ import annotations

import math

import pytest

from gateway.http.retry_after import retry_after_headers, retry_after_seconds


@pytest.mark.parametrize(
    ("seconds", "whole", "ms"),
    [
        (6.5, "7", "6500"),  # an engine's wait passed through: rounded up for Retry-After, exact in ms
        (7, "7", "7000"),
        (1, "1", "1000"),
        (0.2, "1", "200"),  # a wait is owed: at least one whole second, the milliseconds exact
        (0.1, "1", "100"),  # (0.1 * 1000 is 100.00000000000001 in floats: still 100)
        (2.0001, "3", "2001"),  # a part of a millisecond is rounded up: never back before the wait is over
        (0.0004, "1", "1"),
        (120, "120", "120000"),  # long waits as they are: the SDK backs off by itself past its cap
    ],
)
def test_retry_after_is_whole_seconds_rounded_up_and_the_milliseconds_are_exact(
    seconds: float, whole: str, ms: str
) -> None:
    assert retry_after_headers(seconds) == {"Retry-After": whole, "retry-after-ms": ms}


@pytest.mark.parametrize("seconds", [0, -3, math.nan, math.inf, -math.inf])
def test_a_wait_that_says_nothing_is_one_second_in_both_headers(seconds: float) -> None:
    # "retry-after-ms: 0" would make the SDK drop it and back off by its own schedule, disagreeing with the
    # "Retry-After: 1" beside it: both say the one-second floor instead.
    assert retry_after_headers(seconds) == {"Retry-After": "1", "retry-after-ms": "1000"}


@pytest.mark.parametrize("seconds", [0.2, 1, 6.5, 59.999])
def test_the_headers_read_back_as_the_wait(seconds: float) -> None:
    headers = retry_after_headers(seconds)
    assert int(headers["retry-after-ms"]) / 1000 == pytest.approx(seconds, abs=0.001)
    whole = retry_after_seconds(headers["Retry-After"].encode())
    assert whole is not None and seconds <= whole < seconds + 1


@pytest.mark.parametrize(
    "value",
    [
        b"Mon, 01 Jan 99999999999999999999 00:00:00 GMT",  # (OverflowError: no C long holds the year)
        b"Mon, 01 Jan 10000 00:00:00 GMT",  # (ValueError: past datetime's year 9999)
        b"Mon, 01 Jan 2026 99:99:99 GMT",
        b"1e999",
        b"soon",
    ],
)
def test_an_engines_unreadable_retry_after_names_no_wait(value: bytes) -> None:
    assert retry_after_seconds(value) is None
