"""redis-py connections that send a command under ``asyncio.timeout`` rather than ``asyncio.wait_for``.

redis-py bounds each send by its socket timeout with ``asyncio.wait_for``. On Python 3.11 that drops a
cancellation which arrives in the loop turn the send completes in (CPython gh-86296, mended in 3.12); a
task looping on commands is in that turn most of the time: of 300 such tasks cancelled at random instants,
246 carried on past the cancellation (tests/gateway/test_redis_sending.py, before this module). A gateway's
writer or follower then outlived its stop, and a request whose client had left went on. Here the same bound
is kept, with the socket timeout unset for the send's duration so that redis-py takes its path without a
timeout, and ``asyncio.timeout`` applied around it, which passes cancellations on; a send past the bound is
redis-py's own "Timeout writing to socket"."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import TimeoutError as RedisTimeoutError


class _SendsUnderTimeout(AbstractConnection):
    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        bound = self.socket_timeout
        if not bound:
            await super().send_packed_command(command, check_health)
            return
        # (A pooled connection serves one task at a time: nothing else reads the timeout meanwhile.)
        self.socket_timeout = None
        try:
            async with asyncio.timeout(bound):
                await super().send_packed_command(command, check_health)
        except TimeoutError:
            # (the send was cancelled inside redis-py, which closed the connection as for any failed send)
            raise RedisTimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = bound


class TcpConnection(_SendsUnderTimeout, Connection):
    """``redis://``"""


class TlsConnection(_SendsUnderTimeout, SSLConnection):
    """``rediss://``"""


class UnixConnection(_SendsUnderTimeout, UnixDomainSocketConnection):
    """``unix://`` (the workers' private Redis)"""


def connection_class(url: str) -> type[Any]:
    """The connection class for a Redis URL's scheme, as redis-py's ``from_url`` would choose it."""
    scheme = url.split(":", 1)[0].lower()
    return {"rediss": TlsConnection, "unix": UnixConnection}.get(scheme, TcpConnection)
