"""A lean connection's read deadlines (header, body rate, idle, a refused body's linger) on one lazy timer,
and the holds on its reading that suspend them."""

from __future__ import annotations

from gateway.http.lean_http_state import BODY, HEAD, IDLE, LINGER, NEVER, LeanConnectionState

BACKLOG_PAUSE_BYTES = 1 << 20  # pipelined bytes held while a request is answered, before reading pauses
MAX_PIPELINED = 64  # requests queued on a connection before the rest of what it sent waits, unparsed


class LeanDeadlines(LeanConnectionState):
    """One timer per connection does every deadline, lazily: it fires at the earliest deadline it was armed
    for and re-arms itself for the deadline of whatever the connection is doing by then, so a busy
    keep-alive connection costs no timer operation per request."""

    # -- holding reading -------------------------------------------------------------------------------

    def _pause_if_backlogged(self) -> None:
        if self._queued_bytes > BACKLOG_PAUSE_BYTES or len(self._queue) >= MAX_PIPELINED:
            self._backlogged = True
            self._hold_reading()

    def _hold_reading(self) -> None:
        if self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def _release_reading(self) -> None:
        """Resume reading unless something still holds it. The wait was this server's doing, so the
        request being read gets its deadline afresh."""
        if (
            not self._reading_paused
            or self._backlogged
            or self._verdict is not None
            or self.transport is None
        ):
            return
        self._reading_paused = False
        self.transport.resume_reading()
        self._began = self._body_began = self._loop.time()
        self._arm(self._deadline())

    # -- deadlines -------------------------------------------------------------------------------------

    def _deadline(self) -> float:
        """When what the connection is doing now is overdue (``NEVER``: while a request is answered, or
        while this server holds reading)."""
        reading = self._reading
        if reading == IDLE:
            if self._task is not None:
                return NEVER
            # Until its first request, a connection gets the header deadline from accept (as nginx's
            # client_header_timeout): a client that connects and sends nothing holds a slot 10 s, not 75.
            return self._idle_since + (self._edge.idle_s if self._served else self._edge.header_s)
        if reading == LINGER:
            return self._linger_until
        if self._reading_paused or self._continue_owed:  # (owed: its body is not due before its 100)
            return NEVER
        if reading == HEAD:
            return self._began + self._edge.header_s
        return self._edge.body_deadline(self._body_began, self._body_bytes + self._discarding)

    def _arm(self, when: float) -> None:
        """Have the timer fire by ``when``. A timer already due earlier stays: it re-arms itself for the
        deadline in force when it fires, which spares a re-arm per request on a busy connection."""
        if self._timer_at <= when or when == NEVER:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, NEVER

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, NEVER
        if self.transport is None:
            return
        deadline = self._deadline()
        if self._loop.time() < deadline:
            self._arm(deadline)
        elif self._reading in (HEAD, BODY):
            self._read_timed_out()
        else:
            self._close()  # idle past idle_timeout_s, or a refused body's linger is over

    def _read_timed_out(self) -> None:
        """The request being read is late (``LeanAnswering`` answers it)."""
        raise NotImplementedError
