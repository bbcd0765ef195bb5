"""The kvgate command: help, a bad deployment file, and `kvgate demo` run and stopped as a user would."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from gateway.demo import free_port
from tests.serving import bindable

KVGATE = [sys.executable, "-m", "gateway.cli"]


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVGATE, *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command() -> None:
    result = run("--help")
    assert result.returncode == 0
    for command in ("serve", "demo", "sim-engine"):
        assert command in result.stdout


def test_a_bad_deployment_file_is_named_and_refused(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('region = "a"\n[[regions]]\nname = "a"\nengines = [{ name = "e0", url = "ftp://x" }]\n')
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "regions.0.engines.0.url" in result.stderr
    assert "Traceback" not in result.stderr


def _the_printed_gets_answer(printed: str, api_key: str) -> None:
    """Each one-line GET the demo prints (`curl -s URL ...`) is answered 200, sent as printed: with the key
    where the line sends ``$KVGATE_API_KEY``, without one where it does not."""
    gets = [line.split()[2:] for line in printed.splitlines() if line.startswith("  curl -s http")]
    assert len(gets) >= 4, printed
    for url, *rest in gets:
        if url.endswith("/completions"):
            continue  # (the POSTs: sent with the SDK below)
        headers = {"Authorization": f"Bearer {api_key}"} if "$KVGATE_API_KEY" in " ".join(rest) else {}
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                status = r.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status == 200, (url, rest, status)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("engines", ["real", "simulated", "pd", "auth"])
def test_demo_serves_and_stops_everything_on_ctrl_c(tmp_path: Path, engines: str) -> None:
    port = free_port()
    extra = {"simulated": ["--simulated"], "pd": ["--pd"], "auth": ["--simulated", "--auth"]}.get(engines, [])
    model = "kvgate-sim" if engines in ("simulated", "auth") else "kvgate-tiny"
    demo = subprocess.Popen(
        [*KVGATE, "demo", "--port", str(port), "--regions", "2", "--engines-per-region", "1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        # The demo writes its tiny model into the cache directory: keep it inside the test's.
        env={**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(tmp_path)},
    )
    try:
        deadline = time.monotonic() + 120
        health = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    health = json.loads(r.read())
                    break
            except OSError:
                time.sleep(0.2)
        assert health is not None, "the demo gateway never answered"
        api_key, printed = "unused", ""
        if engines == "auth":  # the tour prints a key per demo tenant; requests without one are refused
            assert health == {"status": "ok"}  # (engines and their addresses are for admin keys)
            assert demo.stdout is not None
            while "export KVGATE_API_KEY=" not in printed:
                printed += demo.stdout.readline()
            api_key = printed.split("export KVGATE_API_KEY=")[1].split()[0]
            assert printed.count("kvg-") >= 2
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {api_key}"}
            )
            with urllib.request.urlopen(request, timeout=5) as r:  # acme's key is an admin's
                health = json.loads(r.read())
            while "Ctrl-C stops" not in printed:
                printed += demo.stdout.readline()
            _the_printed_gets_answer(printed, api_key)
            anonymous = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="kvg-nope", max_retries=0
            )
            with pytest.raises(openai.AuthenticationError):
                anonymous.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
        assert health["engines_total"] == (4 if engines == "pd" else 2)
        engine_ports = [int(e["url"].rsplit(":", 1)[1]) for e in health["engines"]]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0)
        messages = [{"role": "system", "content": "be brief " * 40}, {"role": "user", "content": "hello"}]
        headers = {"x-session-affinity": "demo-test"}
        first = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=4,
            extra_headers=headers,  # type: ignore[arg-type]
        )
        second = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=4,
            extra_headers=headers,  # type: ignore[arg-type]
        )
        assert first.headers["x-kvgate-engine"].split("/")[0] in {"eu-west", "us-east"}
        if engines == "pd":  # answered by a decode engine (a short prompt is prefilled there too)
            assert first.headers["x-kvgate-decode-engine"].endswith("/d0")
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        assert (second.usage.model_extra or {}).get("cost", 0) > 0  # the demo prices its model

        demo.send_signal(signal.SIGINT)
        demo.wait(timeout=30)
        assert demo.stdout is not None
        out = printed + demo.stdout.read()  # the same reader: readline() above may have buffered more
        assert demo.returncode == 0
        assert "curl" in out and "stopped" in out
        assert not any(_port_open(p) for p in [port, *engine_ports])
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def test_every_subcommand_has_help() -> None:
    from gateway.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices  # type: ignore[union-attr]
    assert {"serve", "demo", "simulate", "keys", "usage", "engine", "sim-engine", "make-model"} <= set(
        commands
    )
    for name in [*commands, "keys create", "keys list", "keys revoke"]:
        result = run(*name.split(), "--help")
        assert result.returncode == 0, (name, result.stderr)
        assert result.stdout.startswith(f"usage: kvgate {name}") and "Traceback" not in result.stderr


def _distinct_ports() -> tuple[int, int, int]:
    """An engine port, a gateway port and an operator port p with p + 1 free too, all four different, taken
    below the kernel's ephemeral range: a port there is never the local end of some outgoing connection
    (a health probe, a Redis client) by the time a server binds it, as a free port from bind(0) can be,
    and as operator + 1 was in a CI run ("address already in use")."""
    low = _ephemeral_low()
    rng = random.Random()
    while True:
        engine, public, operator = (rng.randrange(10_000, low - 1) for _ in range(3))
        ports = {engine, public, operator, operator + 1}
        if len(ports) == 4 and all(bindable(p) for p in ports):
            return engine, public, operator


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def test_serve_with_two_workers_shares_the_port(tmp_path: Path) -> None:
    engine_port, port, operator = _distinct_ports()
    engine = subprocess.Popen(
        [sys.executable, "-m", "engine.sim", "--port", str(engine_port), "--model", "kvgate-sim"],
        stderr=subprocess.DEVNULL,
    )
    gateway_log = tmp_path / "gateway.log"
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\n'
        f'engines = [{{ name = "e0", url = "http://127.0.0.1:{engine_port}" }}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{tmp_path / "spool"}"\noperator_port = {operator}\n'
    )
    with gateway_log.open("wb") as log_file:
        gateway = subprocess.Popen(
            [*KVGATE, "serve", "--config", str(config), "--workers", "2"], stderr=log_file
        )
    try:
        ids: set[str] = set()
        deadline = time.monotonic() + 60
        while len(ids) < 2 and time.monotonic() < deadline:
            try:  # every request on a new connection: the kernel spreads them over the workers
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    ids.add(json.loads(r.read())["gateway_id"])
            except OSError:
                time.sleep(0.2)
        assert len(ids) == 2 and all(i.endswith(("-w0", "-w1")) for i in ids), gateway_log.read_text()
        body = json.dumps(
            {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        )
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.status == 200
        # Each worker has an operator port of its own (operator_port + its index), whose metrics are its own.
        workers = set()
        for p in (operator, operator + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{p}/health", timeout=5) as r:
                workers.add(json.loads(r.read())["gateway_id"])
        assert workers == ids
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(30) == 0
        assert not _port_open(port)
    finally:
        for process in (gateway, engine):
            if process.poll() is None:
                process.kill()
                process.wait()


def test_workers_need_a_fixed_port(tmp_path: Path) -> None:
    config = tmp_path / "deploy.toml"
    engines = 'engines = [{ name = "e0", url = "http://h:1" }]\n'
    config.write_text(f'region = "r"\n[[regions]]\nname = "r"\n{engines}[gateway]\nport = 0\n')
    result = run("serve", "--config", str(config), "--workers", "2")
    assert result.returncode == 2 and "fixed port" in result.stderr
