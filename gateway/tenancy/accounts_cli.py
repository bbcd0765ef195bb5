"""``kvgate keys create|list|revoke`` and ``kvgate usage``: the operator's side of tenants and billing.

Both talk to where the gateways keep their state: Redis (``--redis`` or the deployment file's
``gateway.redis_url``) or, for keys without Redis, a keys file (``--keys-file`` or
``gateway.auth.keys_file``).
``kvgate usage --url`` asks a running gateway instead (its in-process ledger, when it has no Redis).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import aiohttp
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import MovedError

from cache.ledger import dollars
from cache.ledger_redis import RedisLedger
from cache.redis_client import REDIS_FAILURES, AnyRedis
from gateway.http.errors import InvalidRequest
from gateway.tenancy.tenants import FileKeyStore, KeyStore, RedisKeyStore, create_key, is_tenant_name
from gateway.tenancy.usage_api import day_range, usage_list
from gateway.user_errors import UserError, without_credentials
from region_map.config import ConfigError

REDIS_TIMEOUT_S = 3.0  # connecting, and each reply: a Redis that is away is said in seconds


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = subparsers.add_parser(
        "keys",
        help="create, list and revoke API keys",
        description="API keys of tenants. A key is printed once, when it is created; only its SHA-256 "
        "is stored.",
    )
    actions = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="create a key for a tenant and print it (once)")
    create.add_argument("--tenant", required=True, help="tenant name (letters, digits, '_', '.', '-')")
    create.add_argument("--name", default="", help="a label for the key (shown by 'keys list')")
    listing = actions.add_parser("list", help="list keys (ids and tenants; never the keys)")
    listing.add_argument("--tenant", help="only this tenant's keys")
    revoke = actions.add_parser("revoke", help="revoke a key by its id (see 'keys list')")
    revoke.add_argument("key_id")
    for sub in (create, listing, revoke):
        _store_options(sub)
        sub.set_defaults(func=_keys)

    usage = subparsers.add_parser(
        "usage",
        help="usage and cost per tenant and day, from the ledger",
        description="Usage and cost per tenant and day. Reads the ledger in Redis, or asks a gateway "
        "(--url, with an admin key in --key or KVGATE_API_KEY when it requires one).",
    )
    usage.add_argument("--tenant", help="only this tenant")
    usage.add_argument("--start", help="first day, YYYY-MM-DD, YYYYMMDD or Unix seconds (default: --end)")
    usage.add_argument("--end", help="last day (default: today, UTC)")
    usage.add_argument("--url", help="a gateway's base URL, e.g. http://127.0.0.1:8080")
    usage.add_argument("--key", default=os.environ.get("KVGATE_API_KEY"), help="admin API key for --url")
    usage.add_argument("--json", action="store_true", help="print the gateway's JSON answer shape")
    _store_options(usage, keys_file=False)
    usage.set_defaults(func=_usage)


def _store_options(parser: argparse.ArgumentParser, *, keys_file: bool = True) -> None:
    parser.add_argument("--config", help="deployment file (its gateway.redis_url / gateway.auth.keys_file)")
    parser.add_argument("--redis", metavar="URL", help="Redis the gateways share")
    parser.add_argument("--redis-prefix", default=None, help="key prefix (default: the config's, or kvgate)")
    parser.add_argument(
        "--redis-cluster", action="store_true", help="--redis is a Redis Cluster node (default: the config's)"
    )
    if keys_file:
        parser.add_argument("--keys-file", help="keys file, when the gateways have no Redis")


class Stores(NamedTuple):
    """Where the gateways keep keys and the ledger, as the flags and the deployment file say."""

    redis_url: str | None
    keys_file: str | None
    prefix: str
    cluster: bool  # redis_url is a Redis Cluster node


def _settings(args: argparse.Namespace) -> Stores:
    """The stores from the flags, then the deployment file."""
    redis_url, keys_file, prefix = args.redis, getattr(args, "keys_file", None), args.redis_prefix
    cluster: bool = args.redis_cluster
    if redis_url is not None:
        from gateway.config import check_redis_url

        try:
            check_redis_url(redis_url)
        except ValueError as exc:
            raise ConfigError(f"--redis: {exc}") from None
    if args.config:
        from gateway.config import load_config

        config = load_config(args.config, environ=os.environ).gateway
        if redis_url is None:
            redis_url = config.redis_url
            cluster = cluster or config.redis_cluster
        keys_file = keys_file or config.auth.keys_file
        prefix = prefix or config.redis_prefix
    return Stores(redis_url, keys_file, prefix or "kvgate", cluster)


def _keys(args: argparse.Namespace) -> int:
    stores = _settings(args)
    if stores.keys_file is None and stores.redis_url is None:
        raise ConfigError("say where keys live: --redis URL, --keys-file FILE, or --config FILE")
    if stores.keys_file is not None:
        return asyncio.run(_keys_async(args, stores))
    with _redis_reached(str(stores.redis_url), "the keys"):
        return asyncio.run(_keys_async(args, stores))


async def _keys_async(args: argparse.Namespace, stores: Stores) -> int:
    client: AnyRedis | None = None
    store: KeyStore
    if stores.keys_file:
        store = FileKeyStore(stores.keys_file)
    else:
        client = _redis(str(stores.redis_url), cluster=stores.cluster)
        store = RedisKeyStore(client, stores.prefix)
    try:
        if args.keys_command == "create":
            if not is_tenant_name(args.tenant):
                raise ConfigError("--tenant: 1-63 letters, digits, '_', '.' or '-'")
            key, record = await create_key(store, args.tenant, args.name)
            print(key)
            print(
                f"key {record.key_id} for tenant {record.tenant}: shown once, store it now "
                "(send it as 'Authorization: Bearer <key>')",
                file=sys.stderr,
            )
        elif args.keys_command == "list":
            records = [r for r in await store.list() if args.tenant in (None, r.tenant)]
            print(f"{'KEY ID':14} {'TENANT':24} {'CREATED (UTC)':20} NAME")
            for r in records:
                created = dt.datetime.fromtimestamp(r.created, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
                print(f"{r.key_id:14} {r.tenant:24} {created:20} {r.name}")
        else:
            if not await store.remove(args.key_id):
                print(f"kvgate keys: no key with id {args.key_id}", file=sys.stderr)
                return 1
            print(f"revoked key {args.key_id} (gateways stop accepting it within a minute)", file=sys.stderr)
        return 0
    finally:
        if client is not None:
            await client.aclose()


def _usage(args: argparse.Namespace) -> int:
    query = {k: v for k, v in (("start", args.start), ("end", args.end)) if v}
    try:  # before asking anyone: a mistyped day was an "unexpected error" (status 1), or a gateway's 400
        start, end = day_range(query)
    except InvalidRequest as exc:
        raise ConfigError(f"--{exc.param}: {exc.message}") from None
    if args.url:
        # (The gateway totals the tenant asked for: its total of every tenant was printed under one.)
        tenant = {"tenant": args.tenant} if args.tenant else {}
        body = asyncio.run(_usage_from_gateway(args.url, args.key, {**query, **tenant}))
    else:
        redis_url, _, prefix, cluster = _settings(args)
        if redis_url is None:
            raise ConfigError(
                "the ledger is in Redis (--redis URL or --config FILE) or a gateway (--url URL)"
            )
        with _redis_reached(redis_url, "the ledger"):
            body = asyncio.run(_usage_from_redis(redis_url, prefix, start, end, args.tenant, cluster=cluster))
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        _print_usage(body)
    return 0


async def _usage_from_gateway(url: str, key: str | None, query: dict[str, str]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    endpoint = url.rstrip("/") + "/v1/admin/usage"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
            session.get(endpoint, params=query, headers=headers) as r,
        ):
            text = await r.text()
            status = r.status
    except aiohttp.InvalidURL:
        raise UserError(
            f"--url {url}: not a URL; give a gateway's base URL, e.g. http://127.0.0.1:8080"
        ) from None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        reason = str(exc) or type(exc).__name__
        raise UserError(
            f"cannot reach a gateway at {url}: {reason}; is it running there (kvgate serve, kvgate demo)? "
            "Check --url"
        ) from exc
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if status == 200 and isinstance(body, dict):
        return body
    message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    said = f" ({message})" if message else ""
    if status == 401:
        fix = (
            "pass an admin API key with --key or KVGATE_API_KEY"
            if key is None
            else "the key given (--key or KVGATE_API_KEY) is not one of its keys: check it, or create one "
            "with kvgate keys create --tenant NAME for a tenant with admin = true"
        )
        raise UserError(f"{url} refused the key: 401{said}; {fix}")
    if status == 403:
        raise UserError(
            f"{url} answered 403{said}: every tenant's usage needs an admin key (a tenant with admin = true "
            f"in the deployment file's [tenants]); a tenant's own key reads its usage at {url}/v1/usage"
        )
    if status == 404:
        raise UserError(f"{url} answered 404 to /v1/admin/usage: is it a kvgate gateway? Check --url")
    raise UserError(f"{url} answered {status}{said} to /v1/admin/usage; its log says more")


@contextlib.contextmanager
def _redis_reached(redis_url: str, what: str) -> Iterator[None]:
    """A Redis that cannot be reached (or refuses us) as one line with the fix, instead of redis-py's
    traceback."""
    try:
        yield
    except REDIS_FAILURES as exc:
        reason = str(exc).rstrip(".") or type(exc).__name__
        if isinstance(exc, MovedError):  # (a plain client on a cluster node: the key is on another node)
            raise UserError(
                f"Redis at {without_credentials(redis_url)} is a Redis Cluster node: add --redis-cluster "
                "(or set gateway.redis_cluster = true in --config's file)"
            ) from exc
        raise UserError(
            f"cannot reach Redis at {without_credentials(redis_url)} (it holds {what}): {reason}; start "
            "Redis there, or point --redis (or --config) at the Redis the gateways use"
        ) from exc


def _redis(url: str, *, cluster: bool) -> AnyRedis:
    if cluster:
        return RedisCluster.from_url(
            url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S
        )
    return aioredis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S)


async def _usage_from_redis(
    redis_url: str, prefix: str, start: str, end: str, tenant: str | None, *, cluster: bool
) -> dict[str, Any]:
    """The ledger's usage, shaped as a gateway's answer (it had no ``total``, and no ``object`` per day)."""
    client = _redis(redis_url, cluster=cluster)
    try:
        by_tenant = await RedisLedger(client, prefix).tenants(start, end)
    finally:
        await client.aclose()
    return usage_list(start, end, by_tenant, tenant)


def _print_usage(body: dict[str, Any]) -> None:
    print(f"usage {body['start']} .. {body['end']} (UTC)")
    print(
        f"{'TENANT':20} {'DAY':10} {'REQUESTS':>9} {'PROMPT':>12} {'CACHED':>12} {'HIT':>6} "
        f"{'OUTPUT':>11} {'COST $':>12}"
    )
    for entry in body["data"]:
        for d in entry["data"]:
            hit = d["cached_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] else 0.0
            print(
                f"{entry['tenant']:20} {d['day']:10} {d['requests']:9d} {d['prompt_tokens']:12d} "
                f"{d['cached_tokens']:12d} {hit:6.1%} {d['completion_tokens']:11d} "
                f"{dollars(d['cost_picodollars']):12.6f}"
            )
