"""``Retry-After`` (RFC 9110 10.2.3): an engine's read (delta-seconds or an HTTP date), and the gateway's own
written with OpenAI's ``retry-after-ms`` beside it."""

from __future__ import annotations

import email.utils
import math
import time


def retry_after_seconds(value: bytes | None) -> float | None:
    """A ``Retry-After`` header's wait in seconds (delta-seconds or an HTTP date); None when absent or
    unreadable."""
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, OverflowError):
        # (OverflowError: a year too large for a C long, "Mon, 01 Jan 99999999999999999999 ...", raised
        # out of the request: a 500 and a traceback instead of the engine's refusal read as naming no wait)
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def retry_after_headers(seconds: float) -> dict[str, str]:
    """The headers of a refusal that owes the client a wait of ``seconds``: ``Retry-After`` in whole seconds
    rounded up, at least 1, and ``retry-after-ms`` in exact milliseconds (rounded up to a whole one).

    The OpenAI Python SDK reads ``retry-after-ms`` first, then ``Retry-After``: with the milliseconds it
    waits 200 ms when 200 ms are owed, not the second that whole seconds round it up to. Long waits are
    written as they are; the SDK backs off on its own schedule past its cap (60 s; 120 s in recent releases).
    A wait that says nothing (zero, negative, not finite) is the one-second floor in both: a
    ``retry-after-ms: 0`` would be dropped by the SDK, which would then disagree with ``Retry-After: 1``."""
    owed = math.isfinite(seconds) and seconds > 0
    # (1e-6: float noise such as 0.1 * 1000 == 100.00000000000001 is not a millisecond more)
    ms = max(1, math.ceil(seconds * 1000 - 1e-6)) if owed else 1000
    return {"Retry-After": str(max(1, -(-ms // 1000))), "retry-after-ms": str(ms)}
