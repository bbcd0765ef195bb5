"""The usage endpoints: what they add up to, their own per-key allowance, and identical reads at the same time
sharing one read of the ledger without hiding a client's own requests from it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.exceptions import RedisError

from cache.ledger import day_of
from gateway.tenancy.tenants import create_key
from tests.gateway.test_tenants_billing import (
    PRICE,
    RATE_HEADERS,
    TENANTS,
    bearer,
    billed_cluster,
    chat,
    cost_of,
    seconds,
)
from tests.harness import MODEL, Cluster, ClusterFactory
from tests.redis_process import RedisProcess


async def test_usage_endpoints_add_up_to_what_clients_were_billed(make_cluster: ClusterFactory) -> None:
    cluster, keys = await billed_cluster(make_cluster)
    seen: dict[str, int] = {"acme": 0, "globex": 0}
    for i in range(6):
        tenant = "acme" if i % 3 else "globex"
        status, body, _ = await cluster.post(
            "/v1/chat/completions", chat(f"question {i}"), headers=bearer(keys[tenant])
        )
        assert status == 200
        seen[tenant] += cost_of(body["usage"])
    assert cluster.session is not None
    async with cluster.session.get(cluster.url + "/v1/usage", headers=bearer(keys["globex"])) as r:
        mine = await r.json()
    assert mine["tenant"] == "globex" and mine["total"]["requests"] == 2
    assert mine["total"]["cost_picodollars"] == seen["globex"]
    async with cluster.session.get(cluster.url + "/v1/admin/usage", headers=bearer(keys["globex"])) as r:
        assert r.status == 403
    today = day_of(time.time())
    async with cluster.session.get(
        cluster.url + f"/v1/admin/usage?start={today}&end={today}", headers=bearer(keys["acme"])
    ) as r:
        everyone = await r.json()
    totals = {t["tenant"]: t["total"]["cost_picodollars"] for t in everyone["data"]}
    assert totals == seen and everyone["total"]["requests"] == 6
    for start in ("yesterday", "99999999999999999999", "²"):  # (a Unix time past 9999 used to be a 500)
        async with cluster.session.get(
            cluster.url + f"/v1/usage?start={start}", headers=bearer(keys["acme"])
        ) as r:
            error = await r.json()
            assert r.status == 400 and error["error"]["param"] == "start", (start, error)


async def get_usage(cluster: Cluster, path: str, key: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    assert cluster.session is not None
    async with cluster.session.get(cluster.url + path, headers=bearer(key)) as r:
        return r.status, await r.json(), dict(r.headers)


async def test_usage_reads_have_an_allowance_of_their_own(make_cluster: ClusterFactory) -> None:
    # Each read flushes the ledger writer and reads up to a year of the ledger: a key that repeats it as
    # fast as the connection answers must meet a limit, as completions do.
    auth = {"enabled": True, "usage_reads_per_minute": 2}
    cluster = await make_cluster({"eu-west": 1}, auth=auth, tenants=TENANTS, prices={MODEL: PRICE})
    keys = {t: (await create_key(cluster.gateway.billing.keys, t))[0] for t in ("acme", "globex")}
    answers = [await get_usage(cluster, path, keys["acme"]) for path in ("/v1/usage", "/v1/admin/usage")]
    assert [status for status, _, _ in answers] == [200, 200]
    for path in ("/v1/usage", "/v1/admin/usage"):  # one allowance for both endpoints
        status, body, headers = await get_usage(cluster, path, keys["acme"])
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", (path, body)
        assert "usage reads" in body["error"]["message"] and 1 <= int(headers["Retry-After"]) <= 60
        assert 0 < int(headers["retry-after-ms"]) <= int(headers["Retry-After"]) * 1000
    assert (await get_usage(cluster, "/v1/usage", keys["globex"]))[0] == 200  # other keys are not affected
    status, _, _ = await cluster.post(
        "/v1/chat/completions", chat("still fine"), headers=bearer(keys["acme"])
    )
    assert status == 200  # nor the key's completions


async def test_identical_usage_reads_at_once_share_one_read_of_the_ledger(
    make_cluster: ClusterFactory, redis_url: str
) -> None:
    auth = {"enabled": True, "usage_reads_per_minute": 600}
    cluster = await make_cluster(
        {"eu-west": 1}, auth=auth, tenants=TENANTS, prices={MODEL: PRICE}, redis_url=redis_url
    )
    billing, n = cluster.gateway.billing, 8
    key = (await create_key(billing.keys, "globex"))[0]
    # A first read takes a lease of the allowance (30 reads), so the burst's admissions need no refill and
    # each request goes on to the ledger read as soon as its caller is known.
    assert (await get_usage(cluster, "/v1/usage", key))[0] == 200
    arrived, read, release = asyncio.Event(), asyncio.Event(), asyncio.Event()
    identified: list[Any] = []
    ledger_reads: list[Any] = []
    # (The key check and the ledger read are wrapped where they are plain Python in the compiled build too.)
    check, daily = billing.authenticator.check, billing.ledger.daily

    async def counted_check(key: str) -> Any:
        record = await check(key)
        identified.append(record)
        if len(identified) == n:
            arrived.set()
        return record

    async def held_daily(*args: Any) -> Any:
        # The real ledger read, its answer held until every request of the burst is in.
        ledger_reads.append(args)
        days = await daily(*args)
        read.set()
        await release.wait()
        return days

    billing.authenticator.check = counted_check  # type: ignore[method-assign]
    billing.ledger.daily = held_daily  # type: ignore[method-assign]
    answers = asyncio.gather(*(get_usage(cluster, "/v1/usage", key) for _ in range(n)))
    await asyncio.wait_for(asyncio.gather(arrived.wait(), read.wait()), 10)
    # A request answered after that read, then a read of its own: it must see the request, so it reads the
    # ledger itself instead of joining the read begun before.
    status, _, _ = await cluster.post("/v1/chat/completions", chat("one more"), headers=bearer(key))
    assert status == 200
    own = asyncio.ensure_future(get_usage(cluster, "/v1/usage", key))
    for _ in range(500):  # (up to 5 s: a read that joined the held one would never get here)
        if len(ledger_reads) == 2:
            break
        await asyncio.sleep(0.01)
    release.set()
    done = await answers
    assert len(ledger_reads) == 2
    assert [status for status, _, _ in done] == [200] * n and all(body == done[0][1] for _, body, _ in done)
    status, mine, _ = await own
    assert status == 200 and mine["total"]["requests"] == done[0][1]["total"]["requests"] + 1
    # A read that overlaps none reads the ledger again: nothing is kept past the read.
    assert (await get_usage(cluster, "/v1/usage", key))[0] == 200 and len(ledger_reads) == 3


# -- OpenAI's x-ratelimit-*-requests on the usage reads -----------------------------------------------------

LIMITED = {"boss": {"admin": True, "requests_per_minute": 5}, "open": {"admin": True}}


def allowance(headers: dict[str, str]) -> tuple[str, str]:
    return headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]


async def test_usage_reads_count_against_the_request_limit_and_say_what_is_left(
    make_cluster: ClusterFactory,
) -> None:
    """A read is a request: a key whose tenant has a request limit pays one for it, before its query is
    validated (as a completion pays before its body is), and every answer after that says what is left,
    as a completion's does: the 200s, a 400, and the 429 once it is spent."""
    auth = {"enabled": True, "usage_reads_per_minute": 100}
    cluster = await make_cluster({"eu-west": 1}, auth=auth, tenants=LIMITED, prices={MODEL: PRICE})
    keys = {t: (await create_key(cluster.gateway.billing.keys, t))[0] for t in LIMITED}
    status, _, headers = await get_usage(cluster, "/v1/usage", keys["boss"])
    assert status == 200 and allowance(headers) == ("5", "4")
    assert (
        0 < seconds(headers["x-ratelimit-reset-requests"]) <= 12
    )  # one request refills in 12 s at 5 a minute
    status, _, headers = await get_usage(cluster, "/v1/admin/usage", keys["boss"])
    assert status == 200 and allowance(headers) == ("5", "3")
    status, body, headers = await get_usage(cluster, "/v1/usage?start=yesterday", keys["boss"])
    assert status == 400 and body["error"]["param"] == "start" and allowance(headers) == ("5", "2")
    status, _, headers = await get_usage(cluster, "/v1/admin/usage?end=nope", keys["boss"])
    assert status == 400 and allowance(headers) == ("5", "1")
    status, _, headers = await get_usage(cluster, "/v1/usage", keys["boss"])
    assert status == 200 and allowance(headers) == ("5", "0")
    for path in ("/v1/usage", "/v1/admin/usage"):
        status, body, headers = await get_usage(cluster, path, keys["boss"])
        assert status == 429 and body["error"]["type"] == "requests", body
        assert allowance(headers) == ("5", "0") and int(headers["Retry-After"]) >= 1
        assert 0 < seconds(headers["x-ratelimit-reset-requests"]) <= 60
    status, _, _ = await cluster.post("/v1/chat/completions", chat("hi"), headers=bearer(keys["boss"]))
    assert status == 429  # the same limit as the key's completions
    status, _, headers = await get_usage(cluster, "/v1/usage", keys["open"])
    assert status == 200 and [name for name in RATE_HEADERS if name in headers] == []  # no limit, no headers


async def test_a_read_past_the_usage_allowance_says_the_request_limit_too(
    make_cluster: ClusterFactory,
) -> None:
    auth = {"enabled": True, "usage_reads_per_minute": 1}
    cluster = await make_cluster({"eu-west": 1}, auth=auth, tenants=LIMITED, prices={MODEL: PRICE})
    key = (await create_key(cluster.gateway.billing.keys, "boss"))[0]
    status, _, headers = await get_usage(cluster, "/v1/usage", key)
    assert status == 200 and allowance(headers) == ("5", "4")
    status, body, headers = await get_usage(cluster, "/v1/usage", key)
    assert status == 429 and "usage reads" in body["error"]["message"]
    assert allowance(headers) == ("5", "3") and int(headers["Retry-After"]) >= 1


async def test_two_keys_sharing_one_failed_read_each_get_their_own_allowance(
    make_cluster: ClusterFactory, redis_url: str
) -> None:
    """Two keys of one tenant reading the same days at once share one read of the ledger, and its failure:
    the one error reaches both, each with its own key's allowance (a copy each, the shared one untouched)."""
    auth = {"enabled": True, "usage_reads_per_minute": 100}
    # (With Redis: its ledger is plain Python in the compiled build too, so its read can be made to fail.)
    cluster = await make_cluster(
        {"eu-west": 1}, auth=auth, tenants=LIMITED, prices={MODEL: PRICE}, redis_url=redis_url
    )
    billing = cluster.gateway.billing
    first, second = [(await create_key(billing.keys, "boss"))[0] for _ in range(2)]
    assert allowance((await get_usage(cluster, "/v1/usage", first))[2]) == ("5", "4")  # first has spent one
    # (The limiter and the ledger are wrapped where they are plain Python in the compiled build too.)
    spend = billing.limiter.spend
    spent: list[str] = []
    ledger_reads: list[Any] = []
    release = asyncio.Event()

    async def counted_spend(bucket: str, *args: Any) -> Any:
        allowance = await spend(bucket, *args)
        spent.append(bucket)  # (the read goes on to join the ledger read with no await in between)
        return allowance

    async def failing_daily(*args: Any) -> Any:
        ledger_reads.append(args)
        await release.wait()
        raise RedisError("the ledger is away")

    billing.limiter.spend = counted_spend  # type: ignore[method-assign]
    billing.ledger.daily = failing_daily  # type: ignore[method-assign]
    answers = asyncio.gather(*(get_usage(cluster, "/v1/usage", key) for key in (first, second)))
    for _ in range(500):  # both past admission, and so both waiting on the one read
        if sum(bucket.endswith(":usage") for bucket in spent) == 2 and ledger_reads:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)
    release.set()
    (status_1, body_1, headers_1), (status_2, body_2, headers_2) = await answers
    assert len(ledger_reads) == 1  # one read, one failure, shared
    assert (status_1, status_2) == (503, 503) and body_1 == body_2
    assert "cannot be read" in body_1["error"]["message"]
    assert allowance(headers_1) == ("5", "3") and allowance(headers_2) == ("5", "4")


async def test_a_ledger_that_cannot_be_read_is_a_503_that_says_when_to_retry(
    make_cluster: ClusterFactory, private_redis: RedisProcess
) -> None:
    # Every other 503 of the gateway says when to come back (Retry-After, and OpenAI's retry-after-ms); this
    # one said nothing, and a client without a backoff of its own retried at once.
    cluster = await make_cluster({"eu-west": 1}, redis_url=private_redis.url)
    private_redis.stop()
    assert cluster.session is not None
    async with cluster.session.get(cluster.url + "/v1/usage") as r:
        error = (await r.json())["error"]
        assert r.status == 503 and error["type"] == "server_error" and "ledger" in error["message"]
        assert (r.headers.get("Retry-After"), r.headers.get("retry-after-ms")) == ("1", "1000")
