"""Which exposition format a ``/metrics`` scrape gets, by its ``Accept`` header: the gateway's and the
engines' (``engine.metrics``) negotiate alike. It lives in ``cache`` because both packages import it and
neither may import the other.

prometheus_client's ``choose_encoder`` takes the ``version`` of the scraper's media range as it comes. One
that is not numbers (``version=1.x``) made it compare a string with an int: a TypeError, so a 500 and a
traceback in the log for every such scrape, which anyone who may read ``/metrics`` could send in a loop. Any
other (``version=99``, ``version=2.0<b>``) was written back into the answer's ``Content-Type``, naming a
format the body is not written in. So a media range whose version is not one the library writes is dropped
before it negotiates, as a server skips a range it does not support: the scrape gets the next range the
scraper listed, or the classic text format.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

# The versions prometheus_client writes (OpenMetrics 0.0.1 is no format it writes, but Prometheus lists it
# behind 1.0.0: kept, the library passes over it as it always did). Media types as the library compares them.
_KNOWN_VERSIONS = {
    "application/openmetrics-text": frozenset({"0.0.1", "1.0.0", "2.0.0"}),
    "text/plain": frozenset({"0.0.4", "1.0.0"}),
}


def choose_format(accept: str) -> tuple[Callable[[Collector], bytes], str]:
    """The encoder and ``Content-Type`` for a scrape with this ``Accept`` header (``""``: none sent)."""
    if "version" not in accept:  # (curl, a browser, and the common case: nothing to check)
        return choose_encoder(accept)
    return choose_encoder(",".join(r for r in accept.split(",") if _known_version(r)))


def _known_version(media_range: str) -> bool:
    """Whether ``media_range`` names no version or one the library writes, read as the library reads it:
    its first ``version=`` parameter, of a media type it negotiates."""
    media_type, *params = media_range.split(";")
    known = _KNOWN_VERSIONS.get(media_type.strip())
    if known is None:
        return True  # (a type the library passes over anyway)
    for param in params:
        key, equals, value = param.strip().partition("=")
        if equals and key == "version":
            return value in known
    return True
