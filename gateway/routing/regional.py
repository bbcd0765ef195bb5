"""Keeping cross-region traffic in proportion.

Sending a request to the region that holds its KV is worth a round trip, but a hot session or prefix must
not drag a home region's whole load onto a remote one. The limiter watches, per home region, the share of
its recent decisions that went to other regions; while that share is at its cap, remote candidates are left
out (unless nothing at home can serve) for that request. The cap limits new remote placements only: a
session already bound to a remote engine keeps it (its affinity is not revoked for the whole region), so
while the cap holds the remote share can only fall as such sessions end or come home. Policies stay pure:
the caller filters their candidates.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from gateway.routing.base import Candidate


class RemoteShareLimiter:
    def __init__(self, max_share: float = 0.2, window: int = 1000) -> None:
        if not 0.0 <= max_share <= 1.0 or window < 1:
            raise ValueError("max_share must lie in [0, 1] and window be positive")
        self.max_share = max_share
        self.window = window
        self._recent: dict[str, deque[bool]] = {}
        self._remote: dict[str, int] = {}

    def share(self, home: str) -> float:
        recent = self._recent.get(home)
        return self._remote.get(home, 0) / len(recent) if recent else 0.0

    def allows_remote(self, home: str) -> bool:
        return self.share(home) < self.max_share

    def eligible(
        self, home: str, candidates: Sequence[Candidate], session_engine: str | None = None
    ) -> Sequence[Candidate]:
        """The candidates a policy may choose from for a request whose client lives in ``home``: at the
        cap, the home region's engines and the engine the request's session is bound to."""
        if self.allows_remote(home):
            return candidates
        local = [c for c in candidates if (c.region == home or c.engine == session_engine) and c.healthy]
        return local if any(c.region == home for c in local) else candidates

    def record(self, home: str, served_in: str) -> None:
        recent = self._recent.setdefault(home, deque())
        remote = served_in != home
        recent.append(remote)
        self._remote[home] = self._remote.get(home, 0) + remote
        if len(recent) > self.window:
            self._remote[home] -= recent.popleft()
