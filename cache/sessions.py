"""Session bindings (contract 4): (tenant, x-session-affinity id) -> (region, engine), with a sliding TTL.

The same store keeps where each stored Responses API response is (its id, behind ``RESPONSE_KEY_PREFIX``,
which no session id holds), with a TTL of its own: an engine keeps a response far longer than a
conversation stays warm in its KV cache, and a client may continue it hours later.

A binding is a strong preference, not a pin: the router may move a session, and the binding moves with it.
Every binding carries the wall-clock time of the routing decision that made it (``made_at``); wherever two
bindings of one session meet (Redis, a gateway's view hearing of another's, a rebuild after an outage), the
newer one wins, so gateways that missed each other's writes still agree once they talk again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

DEFAULT_SESSION_TTL_S = 3600.0
DEFAULT_RESPONSE_TTL_S = 86400.0
# Session ids come from a header or a key that holds no space: a response's name is never a client's session.
RESPONSE_KEY_PREFIX = "response "


def response_key(response_id: str) -> str:
    """The name a stored response's binding is kept under."""
    return RESPONSE_KEY_PREFIX + response_id


@dataclass(frozen=True, slots=True)
class BindingLives:
    """How long a binding lives idle (its TTL, restarted by each use): a session's, or a stored response's."""

    session_s: float = DEFAULT_SESSION_TTL_S
    response_s: float = DEFAULT_RESPONSE_TTL_S

    def of(self, session_id: str) -> float:
        return self.response_s if session_id.startswith(RESPONSE_KEY_PREFIX) else self.session_s


@dataclass(frozen=True, slots=True)
class SessionBinding:
    region: str
    engine: str
    # time.time() seconds when the routing decision made this binding; 0.0 for values stored before bindings
    # were stamped (they lose to any stamped binding).
    made_at: float = 0.0

    def same_as(self, other: SessionBinding | None) -> bool:
        """The same decision: what Redis compares (engine and made_at) when it slides or releases."""
        return other is not None and other.engine == self.engine and other.made_at == self.made_at


@runtime_checkable
class SessionStore(Protocol):
    """Sessions are scoped by tenant: the same id under two tenants names two sessions."""

    ttl_s: float

    async def get(self, tenant: str, session_id: str) -> SessionBinding | None:
        """The live binding, its TTL restarted (sliding); None if absent or expired."""
        ...

    async def bind(self, tenant: str, session_id: str, binding: SessionBinding) -> None:
        """Create or move the binding unless the one held is newer (``made_at``); the TTL of the binding
        held afterwards starts again if it is this one."""
        ...

    async def unbind(self, tenant: str, session_id: str) -> None: ...


# (tenant, session id) -> (binding, monotonic expiry), least recently used first.
_Lane = OrderedDict[tuple[str, str], tuple[SessionBinding, float]]


class MemorySessionStore:
    """Bindings in LRU dicts bounded to ``max_entries`` each (the oldest idle binding goes first).

    Every write and every read moves an entry to the end with a full TTL, so expired entries gather at the
    front: ``sweep_now`` pops them from there and stops at the first live one, which keeps ``live_count``
    cheap. Sessions and stored responses live for different TTLs, so each kind has a dict (a lane) of its
    own, in which that order holds. (A binding adopted from Redis with a shorter remaining life may sit
    behind live ones; it is counted until the sweep reaches it, at most one TTL.)
    """

    def __init__(
        self,
        ttl_s: float = DEFAULT_SESSION_TTL_S,
        *,
        response_ttl_s: float | None = None,
        max_entries: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.lives = BindingLives(ttl_s, ttl_s if response_ttl_s is None else response_ttl_s)
        self._max = max_entries
        self._clock = clock
        self._sessions: _Lane = OrderedDict()
        self._responses: _Lane = OrderedDict()

    def _lane(self, session_id: str) -> _Lane:
        return self._responses if session_id.startswith(RESPONSE_KEY_PREFIX) else self._sessions

    def get_now(self, tenant: str, session_id: str) -> SessionBinding | None:
        """The live binding, its TTL restarted (a read on the request path)."""
        key = (tenant, session_id)
        lane = self._lane(session_id)
        entry = lane.get(key)
        if entry is None:
            return None
        now = self._clock()
        if entry[1] <= now:
            del lane[key]
            return None
        lane[key] = (entry[0], now + self.lives.of(session_id))
        lane.move_to_end(key)
        return entry[0]

    def peek_now(self, tenant: str, session_id: str) -> SessionBinding | None:
        """The live binding, without restarting its TTL (bookkeeping must not keep a session alive)."""
        entry = self._lane(session_id).get((tenant, session_id))
        return entry[0] if entry is not None and entry[1] > self._clock() else None

    def bind_now(
        self, tenant: str, session_id: str, binding: SessionBinding, ttl_s: float | None = None
    ) -> None:
        """Hold ``binding`` whatever was held (this gateway's own decision), for ``ttl_s`` if that is
        shorter than the TTL (a binding adopted from Redis lives no longer there than here)."""
        key = (tenant, session_id)
        full = self.lives.of(session_id)
        life = full if ttl_s is None else min(full, ttl_s)
        lane = self._lane(session_id)
        lane[key] = (binding, self._clock() + life)
        lane.move_to_end(key)
        while len(lane) > self._max:
            lane.popitem(last=False)

    def offer_now(
        self, tenant: str, session_id: str, binding: SessionBinding, ttl_s: float | None = None
    ) -> bool:
        """Newest wins: hold ``binding`` unless the live binding held is at least as new (another gateway's
        binding heard late, or a rebuild, must never undo a newer decision). Returns whether it is held."""
        held = self.peek_now(tenant, session_id)
        if held is not None and held.made_at >= binding.made_at and not binding.same_as(held):
            return False
        self.bind_now(tenant, session_id, binding, ttl_s)
        return True

    def replace_if_now(
        self,
        tenant: str,
        session_id: str,
        expected: SessionBinding,
        new: SessionBinding | None,
        ttl_s: float | None = None,
    ) -> bool:
        """Compare and set: if the live binding is ``expected`` (the same decision: engine and made_at),
        hold ``new`` instead (None: remove it). For corrections decided from a read that took time, or from
        another gateway's message: a binding made meanwhile is left alone."""
        if not expected.same_as(self.peek_now(tenant, session_id)):
            return False
        if new is None:
            self.unbind_now(tenant, session_id)
        else:
            self.bind_now(tenant, session_id, new, ttl_s)
        return True

    def unbind_now(self, tenant: str, session_id: str) -> None:
        self._lane(session_id).pop((tenant, session_id), None)

    def __len__(self) -> int:
        """Entries held, expired ones not yet swept included (see ``live_count``)."""
        return len(self._sessions) + len(self._responses)

    def items_now(self) -> list[tuple[tuple[str, str], SessionBinding]]:
        """Every live binding ((tenant, session id), binding), oldest first in each lane (sessions first)."""
        now = self._clock()
        return [
            (key, binding)
            for lane in (self._sessions, self._responses)
            for key, (binding, expiry) in lane.items()
            if expiry > now
        ]

    def sweep_now(self) -> int:
        """Drop the expired entries at the front of each lane (the least recently used); returns how many.
        Costs what it drops plus two: each entry is dropped once, and a lane's first live one ends it."""
        now = self._clock()
        dropped = 0
        for entries in (self._sessions, self._responses):
            while entries:
                key, (_, expiry) = next(iter(entries.items()))
                if expiry > now:
                    break
                del entries[key]
                dropped += 1
        return dropped

    def live_count(self) -> int:
        """Live bindings (a gauge): the expired ones are swept first, so this costs what expired since the
        last sweep, never a scan of every session."""
        self.sweep_now()
        return len(self)

    async def get(self, tenant: str, session_id: str) -> SessionBinding | None:
        return self.get_now(tenant, session_id)

    async def bind(self, tenant: str, session_id: str, binding: SessionBinding) -> None:
        self.offer_now(tenant, session_id, binding)

    async def unbind(self, tenant: str, session_id: str) -> None:
        self.unbind_now(tenant, session_id)
