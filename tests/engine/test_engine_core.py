"""The engine core in a process of its own (engine.core) against the engine on a thread: the same greedy
tokens and text, stop strings and min_tokens, client aborts, a killed core, KV transfers through the
core's redirect, and the CLI's shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from engine.core.client import EngineCoreClient
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import SamplingParams
from engine.server import ENGINE_SERVER, EngineServer, ServerConfig, build_app
from tests.serving import serve

pytestmark = pytest.mark.asyncio(loop_scope="module")


def engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(str(model_dir), block_size=4, num_kv_blocks=256, device="cpu")


class Served:
    def __init__(self, runner: web.AppRunner, url: str, session: aiohttp.ClientSession) -> None:
        self.runner, self.url, self.session = runner, url, session
        self.server: EngineServer = runner.app[ENGINE_SERVER]

    @property
    def client(self) -> EngineCoreClient:
        assert isinstance(self.server.engine, EngineCoreClient)
        return self.server.engine

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], Any]:
        async with self.session.post(self.url + path, json=body) as r:
            return r.status, dict(r.headers), await r.json(content_type=None)

    async def stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        async with self.session.post(self.url + "/v1/completions", json={**body, "stream": True}) as r:
            raw = (await r.read()).decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        return [json.loads(e) for e in events if e != "[DONE]"]

    async def health(self) -> tuple[int, dict[str, Any]]:
        async with self.session.get(self.url + "/health") as r:
            return r.status, await r.json()


async def start(engine: LLMEngine | EngineCoreClient, name: str) -> Served:
    runner = web.AppRunner(build_app(engine, ServerConfig(engine_id=name)), handler_cancellation=True)
    return Served(runner, await serve(runner), aiohttp.ClientSession())


async def close(served: Served) -> None:
    await served.session.close()
    await served.runner.cleanup()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def modes(tiny_model_dir: Path) -> AsyncIterator[tuple[Served, Served]]:
    """The same engine on a thread and in a core process."""
    thread = await start(LLMEngine(engine_config(tiny_model_dir)), "thread")
    process = await start(await EngineCoreClient.launch(engine_config(tiny_model_dir)), "process")
    yield thread, process
    await close(thread)
    await close(process)
    assert process.client.process.exitcode == 0  # the app's shutdown stopped the core


def ids(n: int, offset: int) -> list[int]:
    return [(7 * j + offset) % 400 + 5 for j in range(n)]


async def test_greedy_output_is_the_same_in_both_modes(modes: tuple[Served, Served]) -> None:
    thread, process = modes
    for n, salt in ((9, "a"), (23, "b")):
        body = {"prompt_token_ids": ids(n, n), "prompt": "x", "max_tokens": 12, "temperature": 0}
        body["cache_salt"] = salt
        answers = [await served.post("/v1/completions", body) for served in modes]
        assert [a[0] for a in answers] == [200, 200]
        assert answers[0][2]["choices"] == answers[1][2]["choices"]
        assert answers[0][2]["usage"] == answers[1][2]["usage"]  # prompt, cached and completion tokens
        streams = [
            await served.stream({**body, "stream_options": {"include_usage": True}}) for served in modes
        ]
        texts = ["".join(c["choices"][0]["text"] for c in s if c["choices"]) for s in streams]
        assert texts[0] == texts[1] == answers[0][2]["choices"][0]["text"]
        assert streams[0][-1]["usage"] == streams[1][-1]["usage"]
    params = SamplingParams(max_tokens=10, temperature=0)
    thread_engine = thread.server.engine
    got = []
    for engine, rid in ((thread_engine, "t"), (process.client, "p")):
        outs = [out async for out in engine.generate(rid, ids(17, 3), params)]
        got.append(([t for o in outs for t in o.token_ids], "".join(o.text for o in outs)))
    assert got[0] == got[1] and len(got[0][0]) == 10


async def test_stop_strings_and_min_tokens_as_in_thread_mode(modes: tuple[Served, Served]) -> None:
    base = {"prompt_token_ids": ids(11, 40), "prompt": "x", "max_tokens": 16, "temperature": 0}
    _, _, full = await modes[0].post("/v1/completions", {**base, "cache_salt": "full"})
    text = full["choices"][0]["text"]
    at = next(
        i for i in range(2, len(text) - 1) if text.find(text[i : i + 2]) == i and text[i : i + 2].strip()
    )
    stop = text[at : at + 2]
    for extra, salt in (({"stop": [stop]}, "s"), ({"stop": [stop], "min_tokens": 14}, "m")):
        answers = [
            await served.post("/v1/completions", {**base, **extra, "cache_salt": salt}) for served in modes
        ]
        assert answers[0][2]["choices"] == answers[1][2]["choices"]
        assert answers[0][2]["usage"] == answers[1][2]["usage"]
        streams = [await served.stream({**base, **extra, "cache_salt": salt + "-s"}) for served in modes]
        texts = ["".join(c["choices"][0]["text"] for c in s if c["choices"]) for s in streams]
        assert texts[0] == texts[1] == answers[0][2]["choices"][0]["text"]
    _, _, stopped = await modes[1].post("/v1/completions", {**base, "stop": [stop], "cache_salt": "s"})
    assert stopped["choices"][0]["text"] == text[:at] and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < 16
    _, _, held = await modes[1].post("/v1/completions", {**base, "stop": [stop], "min_tokens": 14})
    assert held["choices"][0]["text"].startswith(text[: at + 2])  # the early stop string did not count


async def test_a_client_that_leaves_frees_the_cores_sequence(modes: tuple[Served, Served]) -> None:
    process = modes[1]
    # ignore_eos: a sampled token of the random model may be its EOS, which would end the answer early.
    body = {
        "prompt_token_ids": ids(8, 90),
        "prompt": "x",
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
    }
    response = await process.session.post(process.url + "/v1/completions", json=body)
    assert response.status == 200
    await response.content.readany()
    status, health = await process.health()
    assert health["load"]["running"] == 1
    response.close()
    for _ in range(100):
        status, health = await process.health()
        if health["load"]["running"] == 0:
            break
        await asyncio.sleep(0.05)
    load = health["load"]
    assert status == 200 and health["engine_core"] == "process"
    assert load["running"] == 0 and load["kv_blocks_free"] == load["kv_blocks_total"]


async def test_kv_routes_redirect_to_the_core_and_transfers_go_through(modes: tuple[Served, Served]) -> None:
    thread, process = modes
    async with process.session.post(process.url + "/v1/kv/cached", json={}, allow_redirects=False) as r:
        assert r.status == 307 and r.headers["Location"].endswith(
            f":{process.client.info.kv_port}/v1/kv/cached"
        )
    prompt = ids(30, 7)
    body = {"prompt_token_ids": prompt, "prompt": "x", "max_tokens": 4, "temperature": 0}
    _, _, direct = await process.post("/v1/completions", body)  # now in the core's prefix cache
    # A KV pull from the core (through the redirect), and a prefill that the core fetches from a peer.
    pull = {"pull_url": process.url, "pull_tokens": 28}
    status, headers, pulled = await thread.post("/v1/completions", {**body, "kv_transfer_params": pull})
    assert status == 200 and int(headers["x-kvgate-kv-transferred-tokens"]) == 28
    assert pulled["choices"] == direct["choices"]
    pd = {"prefill_url": thread.url}
    status, headers, decoded = await process.post(
        "/v1/completions", {**body, "cache_salt": "pd", "kv_transfer_params": pd}
    )
    assert status == 200 and headers["x-kvgate-kv-transfer"] == "remote"
    assert decoded["choices"] == direct["choices"]


async def test_a_killed_core_fails_open_requests_cleanly(tiny_model_dir: Path) -> None:
    # A long answer (the whole 4096-token context): under load the client may read its first chunk late, and
    # a shorter one (900 tokens) was once over by then, [DONE] and all, leaving nothing to cut.
    config = dataclasses.replace(engine_config(tiny_model_dir), num_kv_blocks=1024)
    served = await start(await EngineCoreClient.launch(config), "doomed")
    try:
        body = {"prompt_token_ids": ids(8, 5), "prompt": "x", "max_tokens": 4000, "stream": True}
        async with served.session.post(served.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readany()
            os.kill(served.client.process.pid, signal.SIGKILL)
            raw = (await asyncio.wait_for(r.content.read(), 10)).decode()
        assert '"engine_failed"' in raw.split("\n\n")[-2]  # the stream ends with the error event
        status, _, answer = await served.post("/v1/completions", {**body, "stream": False})
        assert status == 503 and answer["error"]["code"] == "engine_failed"
        status, health = await served.health()
        assert status == 503 and health["status"] == "error" and "exited" in health["error"]
    finally:
        await close(served)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_sigterm_of_the_server_stops_the_core(tiny_model_dir: Path) -> None:
    port = _free_port()
    argv = [sys.executable, "-m", "engine", "engine", "--model", str(tiny_model_dir), "--port", str(port)]
    argv += ["--device", "cpu", "--kv-blocks", "64", "--block-size", "4", "--engine-core", "process"]
    server = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE)
    try:
        assert server.stderr is not None
        line = (await asyncio.wait_for(server.stderr.readline(), 60)).decode()
        assert "engine core process" in line, line
        children = await asyncio.to_thread(_children, server.pid)
        assert children  # the core
        server.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(server.wait(), 30) == 0
        left = await asyncio.to_thread(_outlived, children)
        assert not left, left
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()


async def test_the_kernel_tells_the_core_when_its_api_process_dies(tiny_model_dir: Path) -> None:
    """The core asks for SIGTERM on its parent's death (prctl), so that it goes even while it loads a model
    and reads no socket. Shown on a stopped core: after SIGKILL of the API process, a SIGTERM is pending."""
    port = _free_port()
    argv = [sys.executable, "-m", "engine", "engine", "--model", str(tiny_model_dir), "--port", str(port)]
    server = await asyncio.create_subprocess_exec(
        *argv, "--device", "cpu", "--engine-core", "process", stderr=asyncio.subprocess.PIPE
    )
    children: list[int] = []
    try:
        assert server.stderr is not None
        line = (await asyncio.wait_for(server.stderr.readline(), 60)).decode()
        assert "engine core process" in line, line  # said once the core is ready
        children = await asyncio.to_thread(_children, server.pid)
        core = next(pid for pid in children if "spawn_main" in _cmdline(pid))
        os.kill(core, signal.SIGSTOP)
        server.kill()
        await server.wait()
        pending = 0
        for _ in range(100):
            if pending := _pending_signals(core):
                break
            await asyncio.sleep(0.02)
        assert pending & (1 << (signal.SIGTERM - 1))
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def _pending_signals(pid: int) -> int:
    """The process's pending signals, its threads' and its own, as a bit mask (bit n-1: signal n)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _outlived(pids: list[int], wait_s: float = 10.0) -> dict[int, str]:
    """Of ``pids``, those still running after ``wait_s`` (a zombie has ended), with their command lines."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {}
        for pid in pids:
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                    left[pid] = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


async def test_with_tls_the_core_serves_kv_over_https_and_the_redirect_says_so(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import ssl

    import trustme

    ca = trustme.CA()
    cert = tmp_path / "engine.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    client = await EngineCoreClient.launch(engine_config(tiny_model_dir), tls_files=(str(cert), None))
    served = await start(client, "tls")
    try:
        async with served.session.post(served.url + "/v1/kv/cached", json={}, allow_redirects=False) as r:
            location = r.headers["Location"]
        assert r.status == 307 and location.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context()
        ca.configure_trust(trust)
        async with served.session.post(location, json={}, ssl=trust) as r:  # a TLS handshake, then the
            assert r.status == 404 and "model" in (await r.json())["error"]["message"]  # core's own answer
        with pytest.raises(aiohttp.ClientError):  # plain http is not served there
            async with served.session.post(location.replace("https", "http", 1), json={}) as r:
                await r.read()
    finally:
        await close(served)


async def test_auto_is_a_core_process_on_cuda_and_a_thread_on_cpu() -> None:
    from engine.cli import engine_core_mode

    assert engine_core_mode("auto", "cuda") == engine_core_mode("auto", "cuda:1") == "process"
    assert engine_core_mode("auto", "cpu") == "thread"
    assert engine_core_mode("process", "cpu") == "process" and engine_core_mode("thread", "cuda") == "thread"
