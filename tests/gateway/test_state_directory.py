"""The gateway's state directory (its ledger spool and usage journal) removed under a running ``kvgate
serve`` with Redis, as a real process: /health says the crash journal is lost, and the records that neither
Redis nor the spool took are not lost at the stop."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.demo import free_port
from tests.gateway.test_cli_errors import KVGATE, _read_until
from tests.redis_process import RedisProcess

MODEL = "kvgate-sim"


@pytest.fixture
def sim_engine() -> Iterator[int]:
    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "engine.sim", "--port", str(port), "--model", MODEL], stderr=subprocess.DEVNULL
    )
    yield port
    engine.kill()
    engine.wait()


def _health(port: int) -> dict[str, object]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as exc:
        return dict(json.loads(exc.read()))


def _complete(port: int) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 200


def _requests_billed(redis_url: str) -> int:
    result = subprocess.run(
        [*KVGATE, "usage", "--redis", redis_url, "--json"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return sum(day["requests"] for tenant in json.loads(result.stdout)["data"] for day in tenant["data"])


def _deployment(tmp_path: Path, sim_engine: int, spool: Path) -> tuple[RedisProcess, int, list[str]]:
    """A Redis of the test's own, started; the port of a gateway in front of ``sim_engine`` that keeps its
    spool and journal at ``spool`` and its ledger in that Redis; and the command that starts it."""
    (tmp_path / "redis").mkdir()
    redis = RedisProcess(tmp_path / "redis")
    redis.start()
    port = free_port()
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\n'
        f'engines = [{{ name = "e0", url = "http://127.0.0.1:{sim_engine}" }}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{spool}"\nredis_url = "{redis.url}"\n'
    )
    return redis, port, [*KVGATE, "--log-format", "text", "serve", "--config", str(config)]


def _start(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_a_removed_state_directory_loses_no_record_and_health_says_the_journal_is_lost(
    tmp_path: Path, sim_engine: int
) -> None:
    """The journal went on writing into its deleted segment: /health said "journal": "ok" though a crash
    would have lost every request in flight, and a stop with Redis away and the spool refused said "the
    journal keeps them for the next start" of records that were then gone for good."""
    state = tmp_path / "state"
    redis, port, command = _deployment(tmp_path, sim_engine, state / "spool")
    gateway = _start(command)
    try:
        _read_until(gateway, "listening on")
        _complete(port)
        shutil.rmtree(state)
        health = _health(port)
        assert (health["journal"], health["degraded"]) == ("failing", ["journal_failing"]), health
        redis.stop()
        _complete(port)
        _complete(port)
        deadline = time.monotonic() + 30  # (a guard against a hang: the writer retries every second)
        while _health(port)["ledger"] != "unsaved":
            assert time.monotonic() < deadline, _health(port)
            time.sleep(0.2)
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(60) == 0
        assert gateway.stderr is not None
        said = gateway.stderr.read()
        assert "Traceback" not in said and "the journal keeps them" not in said, said
        redis.start()
        gateway = _start(command)
        _read_until(gateway, "listening on")
        assert _requests_billed(redis.url) == 3
    finally:
        if gateway.poll() is None:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(60)
        redis.stop()


def test_a_frozen_redis_is_named_in_the_ledger_s_warning(tmp_path: Path, sim_engine: int) -> None:
    """A Redis stopped with SIGSTOP (or lost behind a network that drops packets) answers nothing: the write
    times out, and the warning said "ledger write failed (); spooling ..." when the write's own timeout
    fired first, its TimeoutError having no message."""
    redis, port, command = _deployment(tmp_path, sim_engine, tmp_path / "spool")
    assert redis.process is not None
    gateway = _start(command)
    try:
        _read_until(gateway, "listening on")
        redis.process.send_signal(signal.SIGSTOP)
        _complete(port)
        said = _read_until(gateway, "ledger write failed").splitlines()[-1]
        # (The write's own 2 s and the Redis client's 2 s socket timeout race: either may be the cause said.)
        causes = ("ledger write failed (no answer within 2 s)", "ledger write failed (Timeout reading from")
        assert any(cause in said for cause in causes), said
    finally:
        redis.process.send_signal(signal.SIGCONT)
        if gateway.poll() is None:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(60)
        redis.stop()


def test_the_journal_goes_on_once_its_directory_is_made_again(tmp_path: Path, sim_engine: int) -> None:
    """/health said the journal was lost until a restart, though the operator had made the directory again."""
    state = tmp_path / "state"
    redis, port, command = _deployment(tmp_path, sim_engine, state / "spool")
    gateway = _start(command)
    try:
        _read_until(gateway, "listening on")
        _complete(port)
        shutil.rmtree(state)
        assert "make the directory again" in _read_until(gateway, "usage journal's directory")
        assert _health(port)["journal"] == "failing"
        state.mkdir()
        assert "is back" in _read_until(gateway, "usage journal's directory")
        assert (_health(port)["journal"], _health(port)["degraded"]) == ("ok", [])
        _complete(port)
        assert [p.name for p in state.iterdir() if ".journal.0" in p.name]  # written where a restart reads
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(60) == 0
        assert _requests_billed(redis.url) == 2
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait(60)
        redis.stop()
