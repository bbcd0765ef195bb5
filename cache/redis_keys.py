"""Redis key layout, in one place.

Every residency key carries the hash tag ``{<prefix>:kv}`` so that the whole index sits in one Redis Cluster
slot: multi-key writes then run as one atomic Lua script and a lookup is one script call. Session keys carry
their own tag, so sessions spread over the cluster.

What Redis holds of residency is a bounded, expiring mirror (warm starts, and approximate records shared
between gateways); routing reads only each gateway's in-process view.
"""

from __future__ import annotations

import xxhash


class RedisKeys:
    def __init__(self, prefix: str = "kvgate", *, db: int = 0) -> None:
        """``db``: the database the keys live in; only the pub/sub channel, which no database holds, names
        it."""
        if not prefix or any(c in prefix for c in "{} "):
            raise ValueError("redis key prefix must be non-empty without braces or spaces")
        self.prefix = prefix
        self.db = db
        self._kv = f"{{{prefix}:kv}}"

    @property
    def block_prefix(self) -> str:
        return f"{self._kv}:b:"

    def block(self, hex_hash: str) -> str:
        """HASH engine -> expiry in ms since the epoch (0 = exact, from KV events). While it holds no exact
        entry the key itself expires (PEXPIREAT) with its latest approximate one."""
        return f"{self._kv}:b:{hex_hash}"

    def engine_blocks(self, engine: str) -> str:
        """SET of the hex hashes ``engine`` has entries for."""
        return f"{self._kv}:e:{engine}"

    def engine_expiry(self, engine: str) -> str:
        """ZSET hex hash -> expiry (ms) of ``engine``'s approximate entries."""
        return f"{self._kv}:x:{engine}"

    @property
    def approximate_engines(self) -> str:
        """SET of the engines whose expiry zset is not empty: while it is empty no block key can expire,
        and writes skip keeping block keys' expiries (what KV events alone cost stays what it was)."""
        return f"{self._kv}:approx"

    @property
    def engine_seq(self) -> str:
        """HASH engine -> last applied event seq (-1: none); also the registry of engines."""
        return f"{self._kv}:seq"

    @property
    def sweep_lock(self) -> str:
        """STRING, set NX with a TTL: the gateway that set it sweeps the expired approximate entries; the
        others skip that round (one sweep per interval per Redis, whatever the number of gateways)."""
        return f"{self._kv}:sweep"

    @property
    def marker(self) -> str:
        """STRING: a random token, set (NX) by a gateway that finds none. A gateway that later finds another
        token, or none, knows that Redis lost what it held (FLUSHDB, a restart without persistence) and
        writes its view back. In the residency index's slot: losing that slot is what it detects."""
        return f"{self._kv}:marker"

    def session(self, tenant: str, session_id: str) -> str:
        digest = xxhash.xxh3_128_hexdigest(f"{tenant}\x00{session_id}".encode())
        return f"{self.prefix}:s:{{{digest}}}"

    @property
    def updates_channel(self) -> str:
        """Pub/sub channel on which gateways announce writes the others' views should follow. Channels are
        global to a Redis server, whatever the database: a deployment in database N > 0 has its own (database
        0 keeps the name it always had)."""
        return f"{self.prefix}:updates" if self.db == 0 else f"{self.prefix}:updates:db{self.db}"
