"""Session bindings (contract 4): (tenant, x-session-affinity id) -> (region, engine), with a sliding TTL.

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


class MemorySessionStore:
    """Bindings in an LRU dict bounded to ``max_entries`` (the oldest idle session goes first).

    Every write and every read moves an entry to the end with a full TTL, so expired entries gather at the
    front: ``sweep_now`` pops them from there and stops at the first live one, which keeps ``live_count``
    cheap. (A binding adopted from Redis with a shorter remaining life may sit behind live ones; it is
    counted until the sweep reaches it, at most one TTL.)
    """

    def __init__(
        self,
        ttl_s: float = DEFAULT_SESSION_TTL_S,
        *,
        max_entries: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], tuple[SessionBinding, float]] = OrderedDict()

    def get_now(self, tenant: str, session_id: str) -> SessionBinding | None:
        """The live binding, its TTL restarted (a read on the request path)."""
        key = (tenant, session_id)
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self._clock()
        if entry[1] <= now:
            del self._entries[key]
            return None
        self._entries[key] = (entry[0], now + self.ttl_s)
        self._entries.move_to_end(key)
        return entry[0]

    def peek_now(self, tenant: str, session_id: str) -> SessionBinding | None:
        """The live binding, without restarting its TTL (bookkeeping must not keep a session alive)."""
        entry = self._entries.get((tenant, session_id))
        return entry[0] if entry is not None and entry[1] > self._clock() else None

    def bind_now(
        self, tenant: str, session_id: str, binding: SessionBinding, ttl_s: float | None = None
    ) -> None:
        """Hold ``binding`` whatever was held (this gateway's own decision), for ``ttl_s`` if that is
        shorter than the TTL (a binding adopted from Redis lives no longer there than here)."""
        key = (tenant, session_id)
        life = self.ttl_s if ttl_s is None else min(self.ttl_s, ttl_s)
        self._entries[key] = (binding, self._clock() + life)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

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
        self._entries.pop((tenant, session_id), None)

    def __len__(self) -> int:
        """Entries held, expired ones not yet swept included (see ``live_count``)."""
        return len(self._entries)

    def items_now(self) -> list[tuple[tuple[str, str], SessionBinding]]:
        """Every live binding ((tenant, session id), binding), oldest first."""
        now = self._clock()
        return [(key, binding) for key, (binding, expiry) in self._entries.items() if expiry > now]

    def sweep_now(self) -> int:
        """Drop the expired entries at the front (the least recently used); returns how many. Costs what
        it drops plus one: each entry is dropped once, and the first live one ends the sweep."""
        now = self._clock()
        entries = self._entries
        dropped = 0
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
        return len(self._entries)

    async def get(self, tenant: str, session_id: str) -> SessionBinding | None:
        return self.get_now(tenant, session_id)

    async def bind(self, tenant: str, session_id: str, binding: SessionBinding) -> None:
        self.offer_now(tenant, session_id, binding)

    async def unbind(self, tenant: str, session_id: str) -> None:
        self.unbind_now(tenant, session_id)
