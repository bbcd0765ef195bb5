"""Notices a ZMQ socket that libzmq left deaf after a message over its size limit (ZMQ_MAXMSGSIZE).

The KV event sockets refuse messages over ``gateway.kv_event_max_message_bytes``, so that one huge (or
corrupt) message cannot take the gateway's memory. libzmq 4.3 does not skip such a message: it treats it
as a protocol error and drops the connection, and a socket that connected (rather than bound) then never
reconnects. It goes deaf, and says nothing. Its monitor tells: the disconnect is followed by neither a new
connection nor a reconnect attempt (a connection that merely broke is retried at once, which the monitor
reports as ``EVENT_CONNECT_RETRIED``). A bound socket keeps listening and its peer reconnects by itself, so
only connecting sockets are watched for it.

``DropWatch`` reads one socket's monitor: register its ``monitor`` in the poller that waits on the socket,
call ``read()`` when it is readable and ``check()`` by ``deadline``; ``check()`` raises ``SocketDropped``
once a disconnect went ``GRACE_S`` without an answer.

Why a timer, and why 0.5 s: libzmq gives no event for the drop itself, only the reconnect's absence. For a
connection it reconnects, its I/O thread reports ``EVENT_CONNECT_RETRIED`` one command after
``EVENT_DISCONNECTED``, with no wait and no I/O between them (the retry event comes when the reconnect timer
is set, not when it fires), so the answer is missed only if that thread is kept off the CPU for the whole
grace period. The follower being busy for longer (a replay, a loaded event loop) misleads nothing:
``check()`` takes in whatever the monitor has queued before it judges.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

GRACE_S = 0.5  # how long a disconnect may go without a reconnect before the socket is taken for deaf

# Signs that libzmq is (re)connecting the socket by itself.
_RECONNECTING = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_ACCEPTED
    | zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
EVENTS = zmq.EVENT_DISCONNECTED | _RECONNECTING | _HANDSHAKE_FAILED


class SocketDropped(Exception):
    """libzmq dropped the socket's connection and will not reconnect it. ``oversized``: the connection had
    completed its handshake, so what ended it was a message over the size limit (a peer speaking another
    protocol fails the handshake instead)."""

    def __init__(self, oversized: bool) -> None:
        why = "a message over the size limit" if oversized else "a failed handshake"
        super().__init__(f"the connection was dropped for {why} and not reconnected")
        self.oversized = oversized


class DropWatch:
    """Watches ``socket``'s monitor for a connection that libzmq dropped for good. ``connects``: whether
    the socket connects (a bound one is never deaf: see the module's docstring)."""

    def __init__(self, socket: zmq.asyncio.Socket, *, connects: bool, grace_s: float = GRACE_S) -> None:
        self._socket = socket
        self._connects = connects
        self._grace_s = grace_s
        self._loop = asyncio.get_running_loop()
        self.monitor: zmq.asyncio.Socket = socket.get_monitor_socket(EVENTS)
        self.deadline: float | None = None  # (loop time) when the last unanswered disconnect makes it deaf
        self._handshaken = False  # the current connection completed its handshake
        self._oversized = False  # what the unanswered disconnect ended: a handshaken connection

    async def read(self) -> int:
        """Take in the monitor's pending events; return how many disconnects they hold."""
        disconnects = 0
        while await self.monitor.poll(0):
            event = parse_monitor_message(await self.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                disconnects += 1
                if self._connects and self.deadline is None:
                    self.deadline = self._loop.time() + self._grace_s
                    self._oversized = self._handshaken
                self._handshaken = False
            elif event & _HANDSHAKE_FAILED:
                self._handshaken = False
            elif event & _RECONNECTING:
                self.deadline = None
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._handshaken = True
        return disconnects

    async def check(self) -> int:
        """Raise ``SocketDropped`` if a disconnect went unanswered for the grace period; return how many
        disconnects the monitor had queued. The queued events are taken in first: the answer may have come
        while the caller was busy past the deadline, unread."""
        disconnects = await self.read()
        if self.deadline is not None and self._loop.time() >= self.deadline:
            raise SocketDropped(self._oversized)
        return disconnects

    async def settle(self) -> bool:
        """Wait for the last disconnect to be answered, the grace period at most; whether the socket was
        left deaf by a message over the size limit."""
        while self.deadline is not None:
            remaining = self.deadline - self._loop.time()
            if remaining <= 0:
                return self._oversized
            if await self.monitor.poll(int(remaining * 1000) + 1):
                await self.read()
        return False

    def close(self) -> None:
        """Stop monitoring (before the socket is closed)."""
        self._socket.disable_monitor()
        self.monitor.close(linger=0)
