"""Where the tests keep their data in the shared Redis: a database of their own and a key prefix per test.

The tests' Redis is ``KVGATE_TEST_REDIS`` (default ``redis://127.0.0.1:6379/15``: database 15, not the
database 0 a gateway uses by default, so a test run never shows a user's gateway keys or tenants it did not
create). Every test that writes there does so under a prefix from ``new_prefix()`` (``kvgate-test-<hex>``);
the prefixes handed out in a session are deleted at its end (tests/conftest.py), and a key that appears
outside them fails the run.
"""

from __future__ import annotations

import os
import uuid

import redis

REDIS_URL = os.environ.get("KVGATE_TEST_REDIS", "redis://127.0.0.1:6379/15")
TEST_PREFIX_MARK = "kvgate-test-"  # every test prefix starts with it, and every key of one contains it

# The prefixes this session handed out (and only these: other sessions may be running on the same Redis).
ISSUED: set[str] = set()


def new_prefix() -> str:
    prefix = f"{TEST_PREFIX_MARK}{uuid.uuid4().hex[:12]}"
    ISSUED.add(prefix)
    return prefix


def prefix_of(key: str) -> str | None:
    """The test prefix a key lives under (``{kvgate-test-ab12...:kv}:b:...`` -> ``kvgate-test-ab12...``)."""
    start = key.find(TEST_PREFIX_MARK)
    if start < 0:
        return None
    end = start + len(TEST_PREFIX_MARK)
    while end < len(key) and key[end] in "0123456789abcdef":
        end += 1
    return key[start:end]


def keys_outside_test_prefixes(client: redis.Redis) -> set[bytes]:
    return {key for key in client.scan_iter(count=1000) if TEST_PREFIX_MARK.encode() not in key}


def delete_prefixes(client: redis.Redis, prefixes: set[str]) -> int:
    """Delete every key under one of ``prefixes`` (one SCAN of the database); how many went."""
    if not prefixes:
        return 0
    doomed = [
        key
        for key in client.scan_iter(match=f"*{TEST_PREFIX_MARK}*", count=1000)
        if prefix_of(key.decode(errors="replace")) in prefixes
    ]
    for i in range(0, len(doomed), 500):
        client.delete(*doomed[i : i + 500])
    return len(doomed)
