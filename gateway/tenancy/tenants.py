"""Tenants and API keys. A key is shown once, when it is created; only its SHA-256 is ever stored.

Keys live in Redis (``{prefix}:keys``, a hash from key digest to tenant) when the gateway has Redis, else
in a keys file of JSON lines that ``kvgate keys create`` appends to and the gateway re-reads when it
changes. The gateway keeps what it has verified in process: a key it has never seen costs one Redis read
(however many requests bring it at once), later requests none (revocations reach it within
``cache_ttl_s``). Only the store's answer is a verdict: while the store is unreachable, keys this gateway
verified before keep working for a bounded while, and any other key gets "cannot verify now"
(``KeyStoreUnavailable``: a 503 with Retry-After), never "no such key".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgpack
from pydantic import BaseModel, ConfigDict, Field

from cache.redis_client import REDIS_FAILURES_OR_LATE, AnyRedis
from gateway.state.single_flight import SingleFlight

log = logging.getLogger(__name__)

KEY_PREFIX = "kvg-"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def is_tenant_name(name: str) -> bool:
    """Whether ``name`` may name a tenant. The whole of it: a pattern anchored with "$" also matched before a
    final newline, so "acme\n" passed, a tenant apart from "acme" (none of its limits or admin right, its
    usage under another name)."""
    return TENANT_NAME.fullmatch(name) is not None


class TenantConfig(BaseModel):
    """One ``[tenants.NAME]`` table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_salt: str | None = Field(default=None, description="default: one derived from the tenant's name")
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    admin: bool = Field(default=False, description="may read every tenant's usage")


@dataclass(frozen=True)
class Tenant:
    name: str
    cache_salt: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    admin: bool = False


def tenant_from_config(name: str, config: TenantConfig | None) -> Tenant:
    config = config or TenantConfig()
    # A salt per tenant by default: equal prompts of two tenants never share KV (no timing side channel).
    salt = config.cache_salt if config.cache_salt is not None else f"tenant:{name}"
    return Tenant(name, salt, config.requests_per_minute, config.tokens_per_minute, config.admin)


@dataclass(frozen=True)
class KeyRecord:
    key_id: str  # the first 12 hex digits of the digest: safe to log and show
    tenant: str
    created: float
    name: str = ""


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(30)


def bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


class KeyStore(Protocol):
    async def add(self, key_digest: str, record: KeyRecord) -> None: ...

    async def get(self, key_digest: str) -> KeyRecord | None: ...

    async def remove(self, key_id: str) -> bool: ...

    async def list(self) -> list[KeyRecord]: ...


class FileKeyStore:
    """Key digests as JSON lines (mode 0600). Appends are atomic lines; removal rewrites the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime in ns) of the file last read
        self._by_digest: dict[str, KeyRecord] = {}

    def _load(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._by_digest, self._seen = {}, None
            return
        # Not the modification time alone: where the file system's clock ticks in whole seconds, a key
        # revoked (the file replaced: a new inode) or created (appended: a new size) within the tick of the
        # last read went unseen for good.
        seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if seen == self._seen:
            return
        entries: dict[str, KeyRecord] = {}
        for number, line in enumerate(self.path.read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            # A line that is not a key (a comment or a typo of a hand edit, a torn write) is skipped, not
            # raised: an error here failed every key's look-up with a 500, the well-formed ones too.
            try:
                raw = json.loads(line)
                record = KeyRecord(raw["key_id"], raw["tenant"], raw["created"], raw.get("name", ""))
                entries[raw["sha256"]] = record
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("%s line %d is not a key and is ignored: %r", self.path, number, exc)
        self._by_digest, self._seen = entries, seen

    async def add(self, key_digest: str, record: KeyRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"sha256": key_digest, **record.__dict__}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    async def get(self, key_digest: str) -> KeyRecord | None:
        self._load()
        return self._by_digest.get(key_digest)

    async def remove(self, key_id: str) -> bool:
        self._load()
        kept = {d: r for d, r in self._by_digest.items() if r.key_id != key_id}
        if len(kept) == len(self._by_digest):
            return False
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"sha256": d, **r.__dict__}) + "\n" for d, r in kept.items()))
        tmp.chmod(0o600)
        tmp.replace(self.path)
        return True

    async def list(self) -> list[KeyRecord]:
        self._load()
        return sorted(self._by_digest.values(), key=lambda r: r.created)


class RedisKeyStore:
    def __init__(self, redis: AnyRedis, prefix: str = "kvgate") -> None:
        self._redis = redis
        self._key = f"{prefix}:keys"

    async def add(self, key_digest: str, record: KeyRecord) -> None:
        await self._redis.hset(self._key, key_digest, msgpack.packb(record.__dict__))

    async def get(self, key_digest: str) -> KeyRecord | None:
        raw = await self._redis.hget(self._key, key_digest)
        return KeyRecord(**msgpack.unpackb(raw)) if raw is not None else None

    async def remove(self, key_id: str) -> bool:
        for key_digest, raw in (await self._redis.hgetall(self._key)).items():
            if msgpack.unpackb(raw)["key_id"] == key_id:
                return bool(await self._redis.hdel(self._key, key_digest))
        return False

    async def list(self) -> list[KeyRecord]:
        raw_records = (await self._redis.hgetall(self._key)).values()
        records = [KeyRecord(**msgpack.unpackb(raw)) for raw in raw_records]
        return sorted(records, key=lambda r: r.created)


async def create_key(store: KeyStore, tenant: str, name: str = "") -> tuple[str, KeyRecord]:
    key = new_key()
    key_digest = digest(key)
    record = KeyRecord(key_digest[:12], tenant, time.time(), name)
    await store.add(key_digest, record)
    return key, record


class KeyStoreUnavailable(Exception):
    """The key store did not answer (Redis away, its pool exhausted, too slow): no verdict on the key."""


class Authenticator:
    """Bearer key -> key record, with verified keys (and the store's recent refusals) remembered in process.

    A cache hit is a dict lookup. A miss reads the store once per key digest however many requests wait on
    it. A store failure raises KeyStoreUnavailable and is never remembered, except that with ``fail_open``
    a key verified before (not since found revoked) is still accepted for up to ``max_stale_s`` past its
    cache entry: Redis being away is then no outage for known clients, at the price that a key revoked while
    this gateway cannot reach Redis works on it until it can again (or that much longer at most).
    """

    def __init__(
        self,
        store: KeyStore,
        *,
        cache_ttl_s: float = 60.0,
        negative_ttl_s: float = 5.0,
        fail_open: bool = True,
        max_stale_s: float = 900.0,
        lookup_timeout_s: float = 1.0,
        max_entries: int = 100_000,
    ) -> None:
        self.store = store
        self._ttl = cache_ttl_s
        self._negative_ttl = negative_ttl_s
        self._fail_open = fail_open
        self._max_stale = max_stale_s
        self._lookup_timeout = lookup_timeout_s
        self._max_entries = max_entries
        self._verified: dict[str, tuple[KeyRecord, float]] = {}  # digest -> (record, fresh until)
        # Kept apart from the verified keys, so that a flood of made-up keys cannot push out the ones that
        # must keep working while the store is away.
        self._refused: dict[str, float] = {}  # digest -> refused until
        self._lookups: SingleFlight[str, KeyRecord | None] = SingleFlight()  # one store read per digest

    async def check(self, key: str) -> KeyRecord | None:
        """The key's record; None if the store has no such key; KeyStoreUnavailable if it cannot say."""
        key_digest = digest(key)
        now = time.monotonic()
        hit = self._verified.get(key_digest)
        if hit is not None and hit[1] > now:
            return hit[0]
        refused_until = self._refused.get(key_digest)
        if refused_until is not None and refused_until > now:
            return None
        try:
            return await self._lookups.run(key_digest, lambda: self._lookup(key_digest))
        except KeyStoreUnavailable:
            if hit is not None and self._fail_open and time.monotonic() < hit[1] + self._max_stale:
                return hit[0]
            raise

    async def _lookup(self, key_digest: str) -> KeyRecord | None:
        try:
            async with asyncio.timeout(self._lookup_timeout):
                record = await self.store.get(key_digest)
        except REDIS_FAILURES_OR_LATE as exc:
            raise KeyStoreUnavailable(str(exc) or type(exc).__name__) from exc
        now = time.monotonic()
        if record is None:
            self._verified.pop(key_digest, None)  # revoked: not even a fallback while the store is away
            if len(self._refused) >= self._max_entries:
                self._refused.clear()
            self._refused[key_digest] = now + self._negative_ttl
        else:
            self._refused.pop(key_digest, None)
            if len(self._verified) >= self._max_entries:
                self._prune(now)
            self._verified[key_digest] = (record, now + self._ttl)
        return record

    def _prune(self, now: float) -> None:
        """Forget the verified keys that could not be used any more, or all of them if that is not enough."""
        horizon = now - self._max_stale if self._fail_open else now
        self._verified = {d: entry for d, entry in self._verified.items() if entry[1] > horizon}
        if len(self._verified) >= self._max_entries:
            self._verified.clear()


class MemoryKeyStore:
    """Key digests in process: for a single gateway that creates its keys itself (``kvgate demo --auth``)."""

    def __init__(self) -> None:
        self._by_digest: dict[str, KeyRecord] = {}

    async def add(self, key_digest: str, record: KeyRecord) -> None:
        self._by_digest[key_digest] = record

    async def get(self, key_digest: str) -> KeyRecord | None:
        return self._by_digest.get(key_digest)

    async def remove(self, key_id: str) -> bool:
        kept = {d: r for d, r in self._by_digest.items() if r.key_id != key_id}
        removed = len(kept) != len(self._by_digest)
        self._by_digest = kept
        return removed

    async def list(self) -> list[KeyRecord]:
        return sorted(self._by_digest.values(), key=lambda r: r.created)
