"""``GatewayError.with_headers``: an error that must carry one caller's headers is copied, never changed.

An error may be shared (one failed ledger read answered to every read that joined it) or kept (an answer
cached for a second): headers set on it in place would reach callers they do not belong to.
"""

from __future__ import annotations

from gateway.http.errors import RateLimited, Unavailable


def test_an_error_given_headers_is_copied_not_changed() -> None:
    error = Unavailable("the ledger is away", code="ledger_away", headers={"Retry-After": "1"})
    twin = error.with_headers({"x-ratelimit-remaining-requests": "4", "Retry-After": "9"})
    assert twin is not error and type(twin) is Unavailable
    assert error.headers == {"Retry-After": "1"}  # the original as it was
    # The error's own headers stay where both name one: it knows its own wait.
    assert twin.headers == {"x-ratelimit-remaining-requests": "4", "Retry-After": "1"}
    assert (twin.status, twin.code, twin.message, twin.param) == (503, "ledger_away", error.message, None)
    assert twin.body() == error.body()
    assert twin.response().headers["x-ratelimit-remaining-requests"] == "4"
    twin.headers["x-request-id"] = "r-1"
    assert "x-request-id" not in error.headers  # the copy's headers are its own dict


def test_each_caller_gets_its_own_copy() -> None:
    shared = RateLimited("slow down")
    shared.type = "tokens"  # (set on the instance, as Billing does: kept by the copy)
    first = shared.with_headers({"x-ratelimit-remaining-requests": "1"})
    second = shared.with_headers({"x-ratelimit-remaining-requests": "7"})
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "7"
    assert shared.headers == {} and first.type == second.type == "tokens"
