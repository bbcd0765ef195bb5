"""A stop under way drains open requests for ``drain_timeout_s``; a second Ctrl-C (SIGINT) ends the drain at
once, as uvicorn's does, and the ledger still gets every record. A second SIGTERM does not (a supervisor
may send one to every process); with ``--workers`` one Ctrl-C to the terminal's process group is one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from cache.ledger import UsageRecord
from cache.ledger_redis import RedisLedger
from tests.gateway.test_cli import KVGATE, _distinct_ports, _port_open
from tests.gateway.test_workers import _engines_healthy
from tests.redis_prefixes import REDIS_URL, new_prefix

MODEL = "kvgate-sim"
LONG = 2000  # output tokens: 40 s at the simulated engine's 20 ms a token, longer than any wait here

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture
def sim_engine() -> Iterator[int]:
    port = _distinct_ports()[0]
    engine = subprocess.Popen(
        [sys.executable, "-m", "engine.sim", "--port", str(port), "--model", MODEL], stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while not _serves_the_model(port):  # (a gateway started before it would not know the model)
        assert engine.poll() is None and time.monotonic() < deadline, "the simulated engine did not start"
        time.sleep(0.1)
    yield port
    engine.kill()
    engine.wait()


def _serve(tmp_path: Path, engine_port: int, *workers: str) -> tuple[subprocess.Popen[bytes], Path, int, str]:
    """``kvgate serve`` in front of one engine, in a process group of its own as a terminal's foreground job
    is (so that the test can signal the group as Ctrl-C does), with a 60 s drain: the process, its log, its
    port and its Redis prefix, once it serves."""
    _, port, operator = _distinct_ports()
    prefix = new_prefix()
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\n'
        f'engines = [{{ name = "e0", url = "http://127.0.0.1:{engine_port}" }}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{tmp_path / "spool"}"\noperator_port = {operator}\n'
        f'redis_url = "{REDIS_URL}"\nredis_prefix = "{prefix}"\n'
        "[gateway.resilience]\ndrain_timeout_s = 60\n"
    )
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log_file:
        gateway = subprocess.Popen(
            [*KVGATE, "--log-format", "text", "serve", "--config", str(config), *workers],
            stderr=log_file,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    count = int(workers[-1]) if workers else 1
    operators = [operator + i for i in range(count)]
    while (
        not all(_port_open(p) for p in (port, *operators))
        or log_path.read_text().count(" listening on ") < count
    ):
        if gateway.poll() is not None or time.monotonic() > deadline:
            os.killpg(gateway.pid, signal.SIGKILL)
            raise AssertionError(log_path.read_text())
        time.sleep(0.1)
    while any(_engines_healthy(p) != 1 for p in operators):  # (each worker sees the engine: else a 404)
        if time.monotonic() > deadline:
            os.killpg(gateway.pid, signal.SIGKILL)
            raise AssertionError(log_path.read_text())
        time.sleep(0.1)
    return gateway, log_path, port, prefix


def _serves_the_model(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            return MODEL in r.read().decode()
    except OSError:
        return False


async def _records(prefix: str) -> list[UsageRecord]:
    client = aioredis.from_url(REDIS_URL)
    try:
        return await RedisLedger(client, prefix).records()
    finally:
        async for key in client.scan_iter(match=f"*{prefix}*"):
            await client.delete(key)
        await client.aclose()


async def _stop_twice_while_streaming(
    port: int, gateway: subprocess.Popen[bytes], log_path: Path, send: list[int]
) -> tuple[int, bytes]:
    """Stream a long answer; signal the gateway's process group with ``send[0]``, check that the stream
    still flows, then with ``send[1]``: the lines streamed after the first signal, and what the stream ended
    with."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": LONG,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
        assert r.status == 200
        assert (await r.content.readline()).startswith(b"data:")
        os.killpg(gateway.pid, send[0])
        await asyncio.sleep(1.0)
        assert gateway.poll() is None, "it stopped at the first signal"  # draining: the stream runs on
        after = 0
        for _ in range(10):
            line = await asyncio.wait_for(r.content.readline(), 5)
            after += line.startswith(b"data:")
        os.killpg(gateway.pid, send[1])
        rest = b""
        with pytest.raises(aiohttp.ClientPayloadError):  # cut: the chunked answer never ends
            rest = await asyncio.wait_for(r.content.read(), 20)
        return after, rest


@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["one", "workers"])
def test_a_second_ctrl_c_ends_the_drain_at_once_and_the_cut_stream_is_billed(
    tmp_path: Path, sim_engine: int, workers: tuple[str, ...]
) -> None:
    """Before, a second Ctrl-C did nothing: the operator waited out the 60 s drain of a 40 s stream, or killed
    the gateway. With workers, the terminal's Ctrl-C reached them too, beside the one kvgate serve passes on:
    one Ctrl-C would have been two, cutting the drain at the first."""
    gateway, log_path, port, prefix = _serve(tmp_path, sim_engine, *workers)
    try:
        after, _ = asyncio.run(
            _stop_twice_while_streaming(port, gateway, log_path, [signal.SIGINT, signal.SIGINT])
        )
        assert after >= 5  # the first Ctrl-C let the stream go on
        began = time.monotonic()
        assert gateway.wait(20) == 0, log_path.read_text()
        assert time.monotonic() - began < 15  # not the drain's 60 s, nor the stream's 40
    finally:
        if gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGKILL)
            gateway.wait()
    log = log_path.read_text()
    assert "a second Ctrl-C ends them now" in log, log
    assert "stopping now: ending the requests still being answered (1;" in log, log
    [record] = asyncio.run(_records(prefix))
    assert record.status == "aborted" and 5 < record.completion_tokens < LONG, record


def test_a_second_sigterm_does_not_cut_the_drain(tmp_path: Path, sim_engine: int) -> None:
    """A supervisor may send SIGTERM to every process of its service, and kvgate serve forwards its own: a
    second SIGTERM is no order to cut the drain short."""
    gateway, log_path, port, prefix = _serve(tmp_path, sim_engine)
    try:

        async def stream() -> None:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
            async with (
                aiohttp.ClientSession() as session,
                session.post(url, json={**body, "stream": True}) as r,
            ):
                assert (await r.content.readline()).startswith(b"data:")
                gateway.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                gateway.send_signal(signal.SIGTERM)
                rest = await asyncio.wait_for(r.content.read(), 20)  # 100 x 20 ms
            assert rest.endswith(b"data: [DONE]\n\n")  # ran to its end

        asyncio.run(stream())
        assert gateway.wait(20) == 0, log_path.read_text()
    finally:
        if gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGKILL)
            gateway.wait()
    assert "stopping now" not in log_path.read_text()
    [record] = asyncio.run(_records(prefix))
    assert record.status == "completed" and record.completion_tokens == 100, record
