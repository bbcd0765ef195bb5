"""The ``cache_salt`` a request is sent with: its namespace of KV blocks, on the engines and in the gateway's
block hashes alike (contract 1: the gateway hashes with the very salt the engine gets).

The tenant's salt keeps tenants apart; a client may split its tenant's namespace further with a salt of its
own (vLLM's convention: one per end user, or a new one for each request). vLLM refuses a salt longer than
128 characters or holding ``@``, ``/``, ``\\`` or NUL (400, ``validate_cache_salt`` in vLLM 0.32), so a
namespace it would refuse is sent as its digest: every request of a tenant whose salt holds a ``/``, and
every one whose client sent a salt of its own, was refused by vLLM engines before.
"""

from __future__ import annotations

import hashlib

# vllm/entrypoints/generate/base/protocol.py (0.32): _MAX_CACHE_SALT_LENGTH, _CACHE_SALT_FORBIDDEN_CHARS.
ENGINE_MAX_SALT_CHARS = 128
ENGINE_FORBIDDEN_SALT_CHARS = frozenset("@/\\\0")
DIGEST_PREFIX = "kvgate-salt:"  # (a joined namespace starts with a digit: never one of these)


def request_cache_salt(tenant_salt: str, client_salt: str | None) -> str:
    """The namespace of a request of a tenant with ``tenant_salt`` whose client sent ``client_salt``;
    "" (no salt sent) only for the tenant with the empty salt whose client sent none."""
    if not client_salt:
        return engine_safe(tenant_salt)
    # Length-prefixed: a client's salt never spells another tenant's (a tenant configured with the empty
    # salt sending "tenant:acme" would otherwise be in acme's namespace), nor another split's ("a:b" + "c"
    # against "a" + "b:c").
    return engine_safe(f"{len(tenant_salt)}:{tenant_salt}:{client_salt}")


def engine_safe(namespace: str) -> str:
    """``namespace`` itself when every engine takes it as ``cache_salt``, else its digest. A cryptographic
    one: a client choosing its own salt must not be able to land in another tenant's namespace."""
    if len(namespace) <= ENGINE_MAX_SALT_CHARS and ENGINE_FORBIDDEN_SALT_CHARS.isdisjoint(namespace):
        return namespace
    digest = hashlib.blake2b(namespace.encode(), digest_size=20).hexdigest()
    return DIGEST_PREFIX + digest
