"""The days of a usage read (``start``/``end`` of GET /v1/usage, /v1/admin/usage and ``kvgate usage``):
ISO 8601 days, extended or basic, or Unix seconds."""

from __future__ import annotations

import pytest

from gateway.http.errors import InvalidRequest
from gateway.tenancy.usage_api import day_range


def test_days_and_unix_seconds_name_the_same_utc_days() -> None:
    assert day_range({"start": "2026-12-01", "end": "2026-12-07"}) == ("2026-12-01", "2026-12-07")
    assert day_range({"start": "1764547200", "end": "1765065600"}) == ("2025-12-01", "2025-12-07")


def test_a_basic_iso_day_is_that_day_not_unix_seconds_of_1970() -> None:
    """``20261207`` is ISO 8601's basic form of 2026-12-07 (``date +%Y%m%d``); read as Unix seconds it was
    1970-08-23, a day no ledger holds, and the read answered an empty total instead of the day's usage."""
    assert day_range({"start": "20261201", "end": "20261207"}) == ("2026-12-01", "2026-12-07")


def test_eight_digits_that_are_no_day_are_still_unix_seconds() -> None:
    assert day_range({"start": "99999999", "end": "99999999"}) == ("1973-03-03", "1973-03-03")


def test_a_start_after_the_end_is_a_400_naming_start() -> None:
    with pytest.raises(InvalidRequest) as raised:
        day_range({"start": "20261208", "end": "20261207"})
    assert raised.value.param == "start"
