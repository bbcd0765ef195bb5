"""The usage endpoints: what they add up to, their own per-key allowance, and identical reads at the same time
sharing one read of the ledger without hiding a client's own requests from it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from cache.ledger import day_of
from gateway.tenancy.tenants import create_key
from tests.gateway.test_tenants_billing import PRICE, TENANTS, bearer, billed_cluster, chat, cost_of
from tests.harness import MODEL, Cluster, ClusterFactory


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
