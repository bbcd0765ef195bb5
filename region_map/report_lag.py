"""The requests an engine's last load reading still counts although this gateway saw them end.

An engine's load (kvgate's ``/health``, vLLM's and SGLang's ``/metrics``) is read every ``health_interval_s``
(1 s by default). A request this gateway sent before a reading was asked for, and that ended since, stays in
that reading until the next one: an agent's next turn, sent as soon as its last answer came back, found the
engine holding its prefix one request busier than it was, and the router could send it away from its cache.
So did its prompt tokens, when the reading found it waiting: the router priced a queue that had gone. The
gateway knows those requests ended; ``stale`` counts them and ``stale_tokens`` the tokens they had to compute,
for ``EngineState`` to take off its load.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ReportLag:
    asked: int = 0  # readings asked for
    ended: int = 0  # requests ended that a reading asked for after they were sent may still count
    ended_tokens: int = 0  # the prompt tokens they had to compute
    _asking: tuple[int, int, int] = (
        0,
        0,
        0,
    )  # (asked, ended, ended_tokens) when the reading under way was asked
    _reading: tuple[int, int, int] = (0, 0, 0)  # the same, for the reading in hand

    def asking(self) -> None:
        """A reading is asked for now."""
        self.asked += 1
        self._asking = (self.asked, self.ended, self.ended_tokens)

    def answered(self) -> None:
        """The reading asked for last is in hand."""
        self._reading = self._asking

    def sent(self) -> int:
        """A request is sent now: the mark to give ``request_ended``."""
        return self.asked

    def request_ended(self, sent_mark: int, prefill_tokens: int) -> None:
        """A request sent at ``sent_mark`` with ``prefill_tokens`` to compute has ended."""
        # A request sent after the reading in hand was asked for is not in it: nothing to take off.
        if sent_mark < self._reading[0]:
            self.ended += 1
            self.ended_tokens += max(prefill_tokens, 0)

    @property
    def stale(self) -> int:
        """Requests the reading in hand counts that have ended since it was asked for."""
        return self.ended - self._reading[1]

    @property
    def stale_tokens(self) -> int:
        """Their prompt tokens to compute: at most what the reading counts as queued for them (whether it
        found them waiting or running, the reading does not say)."""
        return self.ended_tokens - self._reading[2]
