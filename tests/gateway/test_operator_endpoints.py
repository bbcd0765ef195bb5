"""The operator's endpoints tell other tenants' token counts, engine addresses and load: with authentication
on they need keys on the public port, or live on an operator port of their own."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from gateway.config import parse_config
from gateway.tenancy.tenants import create_key
from region_map.config import ConfigError
from tests.harness import MODEL, Cluster, ClusterFactory

TENANTS = {"ops": {"admin": True}, "victim": {}, "snoop": {}}


async def keyed_cluster(make_cluster: ClusterFactory, **gateway: Any) -> tuple[Cluster, dict[str, str]]:
    cluster = await make_cluster({"eu-west": 1}, auth={"enabled": True}, tenants=TENANTS, **gateway)
    store = cluster.gateway.billing.keys
    return cluster, {tenant: (await create_key(store, tenant))[0] for tenant in TENANTS}


async def get(session: aiohttp.ClientSession, url: str, key: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.get(url, headers=headers) as r:
        return r.status, await r.read()


async def test_with_auth_on_the_public_port_shows_operator_data_to_admin_keys_only(
    make_cluster: ClusterFactory,
) -> None:
    cluster, keys = await keyed_cluster(make_cluster)
    assert cluster.session is not None
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "a secret " * 100}]}
    status, _, _ = await cluster.post(
        "/v1/chat/completions", body, headers={"Authorization": f"Bearer {keys['victim']}"}
    )
    assert status == 200
    for path in ("/metrics", "/dashboard", "/dashboard/data", "/dashboard/assets/app.js"):
        assert (await get(cluster.session, cluster.url + path))[0] == 401, path
        assert (await get(cluster.session, cluster.url + path, keys["snoop"]))[0] == 403, path
        assert (await get(cluster.session, cluster.url + path, keys["ops"]))[0] == 200, path
    status, metrics = await get(cluster.session, cluster.url + "/metrics", keys["ops"])
    assert b"kvgate_prompt_tokens_total" in metrics
    # /v1/models, as OpenAI: any valid key.
    assert (await get(cluster.session, cluster.url + "/v1/models"))[0] == 401
    status, models = await get(cluster.session, cluster.url + "/v1/models", keys["snoop"])
    assert status == 200 and MODEL.encode() in models
    # ... and one model's card (the SDK's models.retrieve), and a model that does not exist.
    for name in (MODEL, "no-such-model"):
        assert (await get(cluster.session, f"{cluster.url}/v1/models/{name}"))[0] == 401, name
        assert (await get(cluster.session, f"{cluster.url}/v1/models/{name}", "sk-wrong"))[0] == 401, name
    status, card = await get(cluster.session, f"{cluster.url}/v1/models/{MODEL}", keys["snoop"])
    assert status == 200 and MODEL.encode() in card


async def test_health_tells_a_probe_without_a_key_only_the_status(make_cluster: ClusterFactory) -> None:
    cluster, keys = await keyed_cluster(make_cluster)
    assert cluster.session is not None
    status, bare = await get(cluster.session, cluster.url + "/health")
    assert status == 200 and bare == b'{"status":"ok"}'  # no engine URL, no load
    for key in (keys["snoop"], keys["victim"]):
        assert await get(cluster.session, cluster.url + "/health", key) == (200, bare)
    status, whole = await get(cluster.session, cluster.url + "/health", keys["ops"])
    assert status == 200 and b"engines" in whole and cluster.engines["eu-west/e0"][1].encode() in whole
    assert (await get(cluster.session, cluster.url + "/health", "kvg-not-a-key-0000000000"))[0] == 401


async def test_an_operator_port_serves_them_without_keys_and_the_public_port_not_at_all(
    make_cluster: ClusterFactory,
) -> None:
    cluster, keys = await keyed_cluster(make_cluster, operator_port=0)
    assert cluster.session is not None
    operator = cluster.gateway.operator_url
    assert operator is not None and operator != cluster.url
    for path in ("/metrics", "/dashboard", "/dashboard/data", "/health"):
        status, data = await get(cluster.session, operator + path)
        assert status == 200 and data, path
    assert b"engines" in (await get(cluster.session, operator + "/health"))[1]
    for path in ("/metrics", "/dashboard"):
        assert (await get(cluster.session, cluster.url + path, keys["ops"]))[0] == 404, path
    assert (await get(cluster.session, cluster.url + "/health"))[0] == 200  # the public probe stays


async def test_without_auth_nothing_changes(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1})
    assert cluster.session is not None
    for path in ("/metrics", "/dashboard", "/v1/models"):
        assert (await get(cluster.session, cluster.url + path))[0] == 200, path
    assert b"engines" in (await get(cluster.session, cluster.url + "/health"))[1]


def test_an_operator_port_that_is_the_public_port_is_a_configuration_error() -> None:
    topology = {"region": "r", "regions": [{"name": "r", "engines": [{"name": "e", "url": "http://h:1"}]}]}
    with pytest.raises(ConfigError, match=r"operator_port \(8080\) must differ from port"):
        parse_config({**topology, "gateway": {"port": 8080, "operator_port": 8080}})
    assert parse_config({**topology, "gateway": {"port": 8080, "operator_port": 9464}}).gateway.operator_port
