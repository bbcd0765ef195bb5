"""An engine's ``Retry-After`` header (RFC 9110 10.2.3): delta-seconds or an HTTP date."""

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
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())
