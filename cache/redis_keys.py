"""Redis key layout, in one place.

Every residency key carries the hash tag ``{<prefix>:kv}`` so that the whole index sits in one Redis Cluster
slot: multi-key writes then run as one atomic Lua script and a lookup is one script call. Session keys carry
their own tag, so sessions spread over the cluster.
"""

from __future__ import annotations

import xxhash


class RedisKeys:
    def __init__(self, prefix: str = "kvgate") -> None:
        if not prefix or any(c in prefix for c in "{} "):
            raise ValueError("redis key prefix must be non-empty without braces or spaces")
        self.prefix = prefix
        self._kv = f"{{{prefix}:kv}}"

    @property
    def block_prefix(self) -> str:
        return f"{self._kv}:b:"

    def block(self, hex_hash: str) -> str:
        """HASH engine -> expiry in ms since the epoch (0 = exact, from KV events)."""
        return f"{self._kv}:b:{hex_hash}"

    def engine_blocks(self, engine: str) -> str:
        """SET of the hex hashes ``engine`` has entries for."""
        return f"{self._kv}:e:{engine}"

    def engine_expiry(self, engine: str) -> str:
        """ZSET hex hash -> expiry (ms) of ``engine``'s approximate entries."""
        return f"{self._kv}:x:{engine}"

    @property
    def engine_seq(self) -> str:
        """HASH engine -> last applied event seq (-1: none); also the registry of engines."""
        return f"{self._kv}:seq"

    def session(self, tenant: str, session_id: str) -> str:
        digest = xxhash.xxh3_128_hexdigest(f"{tenant}\x00{session_id}".encode())
        return f"{self.prefix}:s:{{{digest}}}"

    @property
    def updates_channel(self) -> str:
        """Pub/sub channel on which gateways announce writes the others' views should follow."""
        return f"{self.prefix}:updates"
