"""TLS to engines (issue 20): a throwaway CA (trustme), simulated engines served over https, real gateways.

An engine the gateway trusts answers through it, whole and streamed, with its health and KV events read
over TLS too; one it does not trust (unknown CA, certificate for another name) is failed over or answered
with a clear 502/503, never a 500; a URL scheme other than http/https, or a bad CA file, is refused at start.
"""

from __future__ import annotations

import asyncio
import os
import re
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web

from engine.cli import register
from engine.cli_tls import tls_context
from engine.sim.server import SimEngineConfig
from engine.sim.server import build_app as build_sim_app
from gateway.app import GATEWAY, build_app
from gateway.config import parse_config
from gateway.http.server import runner_for
from gateway.http.upstream import UpstreamClients
from gateway.http.upstream_errors import UpstreamConnectError
from gateway.http.upstream_tls import engine_tls_context
from gateway.service import Gateway
from region_map.config import ConfigError
from tests.harness import FAST_SIM, MODEL
from tests.serving import serve

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "engines-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def server_tls(ca: trustme.CA, *names: str, client_ca: trustme.CA | None = None) -> ssl.SSLContext:
    """An engine's server context with a certificate from ``ca`` for ``names``; with ``client_ca`` it
    also demands a client certificate signed by that CA (mutual TLS)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    if client_ca is not None:
        client_ca.configure_trust(context)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class Stack:
    """Engines and gateways started in this loop; all cleaned up after the test."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.session = aiohttp.ClientSession()

    async def engine(self, engine_id: str, tls: ssl.SSLContext | None = None) -> str:
        sim = SimEngineConfig(
            engine_id=engine_id,
            model=MODEL,
            prefill_s_per_token=FAST_SIM["prefill_s_per_token"],
            decode_s_per_token=FAST_SIM["decode_s_per_token"],
        )
        app = build_sim_app(sim)
        runner = runner_for(app)
        self.runners.append(runner)
        return await serve(runner, ssl_context=tls)

    async def gateway(self, engines: dict[str, str], **settings: Any) -> tuple[Gateway, str]:
        engine_options = settings.pop("engine_options", {})
        config = parse_config(
            {
                "region": "eu-west",
                "regions": [
                    {
                        "name": "eu-west",
                        "engines": [
                            {"name": name, "url": url, "model": MODEL, **engine_options.get(name, {})}
                            for name, url in engines.items()
                        ],
                    }
                ],
                "gateway": {"health_interval_s": 0.05, **settings},
            }
        )
        app = build_app(config)
        runner = runner_for(app)
        self.runners.append(runner)
        return app[GATEWAY], await serve(runner)

    async def chat(self, url: str, *, stream: bool = False) -> tuple[int, Any, str]:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        async with self.session.post(url + "/v1/chat/completions", json={**body, "stream": stream}) as r:
            if stream and r.status == 200:
                return r.status, (await r.read()).decode(), r.headers.get("x-kvgate-engine", "")
            return r.status, await r.json(content_type=None), r.headers.get("x-kvgate-engine", "")

    async def close(self) -> None:
        await self.session.close()
        for runner in reversed(self.runners):
            await runner.cleanup()


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    s = Stack()
    yield s
    await s.close()


async def wait_for(predicate: Any, within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def assert_answered(status: int, body: Any, *, stream: bool) -> None:
    assert status == 200, body
    if stream:
        assert body.endswith("data: [DONE]\n\n") and '"content"' in body
    else:
        assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["message"]["content"]


# -- a trusted engine --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_chat_completion_through_an_https_engine(
    stack: Stack, ca: trustme.CA, ca_file: str, stream: bool
) -> None:
    url = await stack.engine("eu-west/tls", server_tls(ca, "127.0.0.1"))
    assert url.startswith("https://")
    gateway, gw_url = await stack.gateway({"tls": url}, engine_tls_ca_file=ca_file)
    engine = gateway.fleet.engines["eu-west/tls"]
    assert engine.healthy, engine.last_error  # the health check spoke TLS with the configured CA
    status, body, answered_by = await stack.chat(gw_url, stream=stream)
    assert_answered(status, body, stream=stream)
    assert answered_by == "eu-west/tls"
    # The KV-event consumer followed the engine over TLS as well.
    await wait_for(lambda: engine.publishes_events is True)


async def test_mutual_tls_sends_the_configured_client_certificate(
    stack: Stack, ca: trustme.CA, ca_file: str, tmp_path: Path
) -> None:
    clients_ca = trustme.CA()
    client = clients_ca.issue_cert("kvgate-gateway")
    cert_file, key_file = tmp_path / "gw.pem", tmp_path / "gw.key"
    client.cert_chain_pems[0].write_to_path(str(cert_file))
    client.private_key_pem.write_to_path(str(key_file))
    url = await stack.engine("eu-west/tls", server_tls(ca, "127.0.0.1", client_ca=clients_ca))
    gateway, gw_url = await stack.gateway(
        {"tls": url},
        engine_tls_ca_file=ca_file,
        engine_tls_cert_file=str(cert_file),
        engine_tls_key_file=str(key_file),
    )
    assert gateway.fleet.engines["eu-west/tls"].healthy
    for stream in (False, True):
        status, body, answered_by = await stack.chat(gw_url, stream=stream)
        assert_answered(status, body, stream=stream)
        assert answered_by == "eu-west/tls"


# -- an engine the gateway does not trust ------------------------------------------------------------------

UNTRUSTED = ["unknown CA", "another hostname"]


async def untrusted_engine(
    stack: Stack, ca: trustme.CA, ca_file: str, why: str
) -> tuple[str, dict[str, Any]]:
    """An https engine, and the gateway settings under which its certificate must be refused."""
    if why == "unknown CA":  # the system store knows nothing of the throwaway CA
        return await stack.engine("eu-west/tls", server_tls(ca, "127.0.0.1")), {}
    # The right CA, but a certificate for a name that is not the one in the engine's URL.
    return await stack.engine("eu-west/tls", server_tls(ca, "engine.example")), {
        "engine_tls_ca_file": ca_file
    }


@pytest.mark.parametrize("why", UNTRUSTED)
async def test_an_untrusted_engine_is_failed_over_to_a_plain_one(
    stack: Stack, ca: trustme.CA, ca_file: str, why: str
) -> None:
    tls_url, settings = await untrusted_engine(stack, ca, ca_file, why)
    plain_url = await stack.engine("eu-west/plain")
    gateway, gw_url = await stack.gateway(
        {"tls": tls_url, "plain": plain_url},
        routing={"policy": "round_robin"},
        health_interval_s=600,  # nothing but the request path may change the engines' health here
        engine_options={"tls": {"kv_events": False}},
        **settings,
    )
    tls = gateway.fleet.engines["eu-west/tls"]
    assert not tls.healthy  # its health check refused the certificate, and says so
    assert tls.last_error is not None
    assert "TLS handshake" in tls.last_error and "certificate refused" in tls.last_error
    tls.healthy = True  # as if it had passed: the request path must refuse the certificate on its own
    for i in range(4):
        status, body, answered_by = await stack.chat(gw_url, stream=i % 2 == 1)
        assert_answered(status, body, stream=i % 2 == 1)
        assert answered_by == "eu-west/plain"
    # Tried once (round robin), refused at the handshake, and marked down as for a refused connection.
    assert not tls.healthy
    assert tls.last_error is not None and "TLS" in tls.last_error and "certificate" in tls.last_error


@pytest.mark.parametrize("why", UNTRUSTED)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_untrusted_only_engine_is_a_clear_error_not_a_500(
    stack: Stack, ca: trustme.CA, ca_file: str, why: str, stream: bool
) -> None:
    tls_url, settings = await untrusted_engine(stack, ca, ca_file, why)
    gateway, gw_url = await stack.gateway(
        {"tls": tls_url}, health_interval_s=600, engine_options={"tls": {"kv_events": False}}, **settings
    )
    # Its health check failed: no engine to send to.
    status, body, _ = await stack.chat(gw_url, stream=stream)
    assert status == 503 and body["error"]["message"], body
    # Healthy as far as the gateway knows: the handshake itself fails, and says why.
    gateway.fleet.engines["eu-west/tls"].healthy = True
    status, body, _ = await stack.chat(gw_url, stream=stream)
    assert status == 502, body
    assert "TLS" in body["error"]["message"] and "certificate" in body["error"]["message"]


# -- the upstream client on its own ------------------------------------------------------------------------


async def test_the_upstream_client_speaks_tls_and_reports_a_refused_certificate(
    stack: Stack, ca: trustme.CA, ca_file: str
) -> None:
    good = await stack.engine("eu-west/good", server_tls(ca, "127.0.0.1"))
    wrong = await stack.engine("eu-west/wrong", server_tls(ca, "engine.example"))
    clients = UpstreamClients(ssl_context=engine_tls_context(ca_file=ca_file))
    try:
        response = await clients.pool(good).request("GET", "/health")
        assert response.status == 200 and b"eu-west/good" in await response.read()
        with pytest.raises(UpstreamConnectError, match=r"TLS handshake with 127\.0\.0\.1:\d+ failed.*"):
            await clients.pool(wrong).request("GET", "/health")
    finally:
        clients.close()


def test_https_defaults_to_port_443() -> None:
    clients = UpstreamClients()
    assert clients.pool("https://engine.example").port == 443
    assert clients.pool("http://engine.example").port == 80


# -- configuration -----------------------------------------------------------------------------------------


def topology(url: str) -> dict[str, Any]:
    return {"region": "r", "regions": [{"name": "r", "engines": [{"name": "e", "url": url}]}]}


@pytest.mark.parametrize("url", ["ftp://10.0.0.5:21", "unix:///run/engine.sock", "ws://10.0.0.5:8000"])
def test_an_engine_url_that_is_neither_http_nor_https_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match=r"regions\.0\.engines\.0\.url: .*http.*https"):
        parse_config(topology(url))


def test_an_https_engine_url_is_accepted() -> None:
    config = parse_config(topology("https://engine.example"))
    assert config.topology.regions[0].engines[0].base_url == "https://engine.example"


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"engine_tls_ca_file": "/nonexistent/ca.pem"}, "engine_tls_ca_file"),
        ({"engine_tls_ca_file": "NOT-PEM"}, "engine_tls_ca_file"),
        ({"engine_tls_cert_file": "/nonexistent/gw.pem"}, "engine_tls_cert_file"),
        ({"engine_tls_key_file": "/nonexistent/gw.key"}, "engine_tls_key_file"),
    ],
)
def test_unusable_tls_files_are_a_config_error_at_start(
    settings: dict[str, str], field: str, tmp_path: Path
) -> None:
    if settings.get("engine_tls_ca_file") == "NOT-PEM":
        bogus = tmp_path / "ca.pem"
        bogus.write_text("this is not a certificate\n")
        settings = {"engine_tls_ca_file": str(bogus)}
    config = parse_config({**topology("https://engine.example"), "gateway": settings})
    with pytest.raises(ConfigError, match=rf"gateway\.{field}: "):
        build_app(config)


# -- serving an engine over TLS ----------------------------------------------------------------------------


def test_the_engine_commands_take_tls_flags(ca: trustme.CA, tmp_path: Path) -> None:
    import argparse

    cert, key = tmp_path / "engine.pem", tmp_path / "engine.key"
    issued = ca.issue_cert("127.0.0.1")
    issued.private_key_and_cert_chain_pem.write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    for command in (["engine", "--model", "m"], ["sim-engine"]):
        args = parser.parse_args([*command, "--port", "0", "--tls-cert", str(cert), "--tls-key", str(key)])
        assert isinstance(tls_context(args), ssl.SSLContext)
        assert tls_context(parser.parse_args([*command, "--port", "0"])) is None
    with pytest.raises(SystemExit):
        tls_context(parser.parse_args(["sim-engine", "--port", "0", "--tls-key", str(key)]))


async def test_kvgate_sim_engine_serves_https(ca: trustme.CA, ca_file: str, tmp_path: Path) -> None:
    cert = tmp_path / "engine.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "engine.sim", "--port", "0", "--tls-cert", str(cert)),
        stderr=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert process.stderr is not None
        line = (await asyncio.wait_for(process.stderr.readline(), 30)).decode()
        match = re.search(r"on (https://127\.0\.0\.1:\d+)", line)
        assert match, line
        connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=ca_file))
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.get(match.group(1) + "/health") as r,
        ):
            assert r.status == 200
    finally:
        process.terminate()
        await process.wait()
