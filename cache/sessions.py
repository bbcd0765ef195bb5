"""Session bindings (contract 4): (tenant, x-session-affinity id) -> (region, engine), with a sliding TTL.

A binding is a strong preference, not a pin: the router may move a session, and the binding moves with it.
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


@runtime_checkable
class SessionStore(Protocol):
    """Sessions are scoped by tenant: the same id under two tenants names two sessions."""

    ttl_s: float

    async def get(self, tenant: str, session_id: str) -> SessionBinding | None:
        """The live binding, its TTL restarted (sliding); None if absent or expired."""
        ...

    async def bind(self, tenant: str, session_id: str, binding: SessionBinding) -> None:
        """Create or move the binding; its TTL starts again."""
        ...

    async def unbind(self, tenant: str, session_id: str) -> None: ...


class MemorySessionStore:
    """Bindings in an LRU dict bounded to ``max_entries`` (the oldest idle session goes first)."""

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

    def bind_now(self, tenant: str, session_id: str, binding: SessionBinding) -> None:
        key = (tenant, session_id)
        self._entries[key] = (binding, self._clock() + self.ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def unbind_now(self, tenant: str, session_id: str) -> None:
        self._entries.pop((tenant, session_id), None)

    def __len__(self) -> int:
        return len(self._entries)

    def items_now(self) -> list[tuple[tuple[str, str], SessionBinding]]:
        """Every live binding ((tenant, session id), binding), oldest first."""
        now = self._clock()
        return [(key, binding) for key, (binding, expiry) in self._entries.items() if expiry > now]

    def live_count(self) -> int:
        now = self._clock()
        return sum(1 for _, expiry in self._entries.values() if expiry > now)

    async def get(self, tenant: str, session_id: str) -> SessionBinding | None:
        return self.get_now(tenant, session_id)

    async def bind(self, tenant: str, session_id: str, binding: SessionBinding) -> None:
        self.bind_now(tenant, session_id, binding)

    async def unbind(self, tenant: str, session_id: str) -> None:
        self.unbind_now(tenant, session_id)
