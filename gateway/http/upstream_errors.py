"""How an exchange with an engine fails: ``UpstreamError`` and its kinds, raised by
``gateway.http.upstream``'s client and its responses (``gateway.http.upstream_response``)."""

from __future__ import annotations


class UpstreamError(Exception):
    """The engine could not be reached or broke the exchange."""

    #: no byte of the response had arrived: the request may be retried on another engine
    before_response: bool = True


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamClosed(UpstreamError):
    pass


class UpstreamProtocolError(UpstreamError):
    pass


class UpstreamEngineDown(UpstreamError):
    """The engine was declared unhealthy while this exchange waited on it in silence."""
