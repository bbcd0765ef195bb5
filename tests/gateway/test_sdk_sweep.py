"""No false refusals of what the OpenAI SDK sends: every parameter and shape of ``tests/sdk_cases.py`` goes
through the real SDK to a gateway in front of recording engines (a vLLM stand-in for chats and completions,
kvgate's simulated engine for embeddings, a simulated Responses engine), and must reach the engine with each
of the client's fields as the client sent them (the gateway may add fields, not drop or alter the client's),
its answer parsed by the SDK without error, usage with ``cached_tokens`` included. What is invalid by
OpenAI's rules, or what the README says the gateway refuses, gets a 400 naming its ``param`` and reaches no
engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from engine.sim.server import SimEngineConfig
from engine.sim.server import build_app as build_sim_app
from tests.harness import FAST_SIM, MODEL, Cluster
from tests.responses_engine import ResponsesEngine
from tests.sdk_cases import (
    CHAT,
    COMPLETION,
    EMBEDDING,
    ENGINE_REFUSES,
    HELLO,
    INVALID,
    REFUSED_AS_VLLM,
    RESPONSES,
)
from tests.serving import serve
from tests.third_party_engines import VllmLikeEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")

VLLM_MODEL = "tiny"  # served by the vLLM stand-in (chats, completions)
RESPONSES_MODEL = "responses-model"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings",
         "responses": "/v1/responses"}  # fmt: skip


@dataclass
class Sweep:
    cluster: Cluster
    client: openai.AsyncOpenAI
    vllm: VllmLikeEngine
    received: list[tuple[str, Any]]  # (path, body) of what the simulated engines were sent

    def sent_to_engines(self, path: str) -> list[Any]:
        vllm = [r.body for r in self.vllm.requests if r.path == path]
        return vllm + [body for p, body in self.received if p == path]

    def forget(self) -> None:
        self.vllm.requests.clear()
        self.received.clear()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def sweep() -> AsyncIterator[Sweep]:
    received: list[tuple[str, Any]] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST":
            received.append((request.path, orjson.loads(await request.read())))
        return await handler(request)  # type: ignore[no-any-return]

    sim = build_sim_app(SimEngineConfig(engine_id="eu-west/sim", model=MODEL, **FAST_SIM))
    responses = ResponsesEngine("r0", model=RESPONSES_MODEL)
    cluster = Cluster(engines={})
    for engine_id, app in (("eu-west/sim", sim), ("eu-west/r0", responses.app)):
        app.middlewares.append(record)
        runner = web.AppRunner(app)
        cluster.engine_runners[engine_id] = runner
        cluster.engines[engine_id] = (app, await serve(runner))
    async with VllmLikeEngine(model=VLLM_MODEL) as vllm:
        cluster.engines["eu-west/v0"] = (vllm, vllm.url)
        cluster.session = aiohttp.ClientSession()
        try:
            await cluster.add_gateway(
                "eu-west",
                engine_options={
                    "eu-west/v0": {"kind": "vllm", "model": VLLM_MODEL, "tools": True, "block_size": 32},
                    "eu-west/r0": {"model": RESPONSES_MODEL, "kv_events": False, "tools": True},
                },
            )
            client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
            yield Sweep(cluster, client, vllm, received)
            await client.close()
        finally:
            await cluster.close()


def _flat(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The body the SDK sends for ``kwargs``: its own fields and ``extra_body``'s."""
    return {**{k: v for k, v in kwargs.items() if k != "extra_body"}, **kwargs.get("extra_body", {})}


def _changed(sent: dict[str, Any], got: dict[str, Any], where: str = "") -> list[str]:
    """The client's fields the engine did not get as sent (a field's own fields compared one by one: the
    gateway may add to ``stream_options``)."""
    out = []
    for key, value in sent.items():
        if key not in got:
            out.append(f"{where}{key} dropped")
        elif isinstance(value, dict) and isinstance(got[key], dict):
            out += _changed(value, got[key], f"{where}{key}.")
        elif got[key] != value:
            out.append(f"{where}{key}: {value!r} became {got[key]!r}")
    return out


async def _call(sweep: Sweep, endpoint: str, kwargs: dict[str, Any]) -> list[Any]:
    """Call the SDK; what it parsed: the answer, or a stream's events."""
    client = sweep.client
    create = {
        "chat": client.chat.completions.create,
        "completions": client.completions.create,
        "embeddings": client.embeddings.create,
        "responses": client.responses.create,
    }[endpoint]
    answer: Any = await create(**kwargs)
    if kwargs.get("stream"):
        return [event async for event in answer]
    return [answer]


def _check_usage(endpoint: str, kwargs: dict[str, Any], parsed: list[Any]) -> None:
    """Usage as the SDK reads it: in a whole answer, in a stream only when asked for (and then with its
    cached tokens)."""
    if endpoint == "responses":
        final = parsed[-1].response if kwargs.get("stream") else parsed[-1]
        assert final.usage is not None and final.usage.input_tokens_details.cached_tokens is not None
        return
    usages = [p.usage for p in parsed if getattr(p, "usage", None) is not None]
    if endpoint == "embeddings":
        assert usages and usages[0].prompt_tokens > 0
        return
    asked = not kwargs.get("stream") or (kwargs.get("stream_options") or {}).get("include_usage")
    if not asked:
        assert usages == [], "a stream that did not ask for usage got it"
        return
    [usage] = usages
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None


CASES = [
    *[("chat", name, {"model": VLLM_MODEL, "messages": HELLO, **kw}) for name, kw in CHAT],
    *[("completions", name, {"model": VLLM_MODEL, "prompt": "hello there", **kw}) for name, kw in COMPLETION],
    *[("embeddings", name, {"model": MODEL, **kw}) for name, kw in EMBEDDING],
    *[("responses", name, {"model": RESPONSES_MODEL, **kw}) for name, kw in RESPONSES],
]


@pytest.mark.parametrize(("endpoint", "name", "kwargs"), CASES, ids=[f"{e}:{n}" for e, n, _ in CASES])
async def test_what_the_sdk_sends_reaches_the_engine_as_sent(
    sweep: Sweep, endpoint: str, name: str, kwargs: dict[str, Any]
) -> None:
    sweep.forget()
    try:
        parsed = await _call(sweep, endpoint, kwargs)
        refused = None
    except openai.APIStatusError as exc:
        parsed, refused = [], exc
    bodies = sweep.sent_to_engines(PATHS[endpoint])
    assert bodies, f"refused by the gateway: {refused and (refused.status_code, refused.body)}"
    sent = _flat(kwargs)
    prompt = sent.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        # (Several prompts: a request each, routed to its own prefix, as the README says.)
        assert len(bodies) == len(prompt)
        sent.pop("prompt")
    if endpoint == "completions" and isinstance(bodies[0].get("prompt"), list):
        # (A vLLM engine whose tokenizer agrees with the gateway's gets the text's ids: the same prompt.)
        sent.pop("prompt", None)
    changes = _changed(sent, bodies[0])
    if changes == ["stream_options.include_usage: False became True"]:
        # (The one change the README names: a stream asks its engine for usage, which billing needs; the
        # client still gets none, as _check_usage checks.)
        changes = []
    assert changes == []
    if f"{endpoint}:{name}" in ENGINE_REFUSES:
        assert refused is not None and refused.status_code == 400  # the engine's own 400, relayed
        return
    assert refused is None, (refused.status_code, refused.body)
    _check_usage(endpoint, kwargs, parsed)


REFUSED = INVALID + REFUSED_AS_VLLM


@pytest.mark.parametrize(
    ("endpoint", "name", "kwargs", "param"), REFUSED, ids=[f"{e}:{n}" for e, n, _, _ in REFUSED]
)
async def test_what_openai_or_the_readme_refuses_is_a_400_naming_the_parameter(
    sweep: Sweep, endpoint: str, name: str, kwargs: dict[str, Any], param: str
) -> None:
    sweep.forget()
    model = {"chat": VLLM_MODEL, "completions": VLLM_MODEL, "responses": RESPONSES_MODEL}.get(endpoint, MODEL)
    with pytest.raises(openai.BadRequestError) as refused:
        await _call(sweep, endpoint, {"model": model, **kwargs})
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == param
    assert refused.value.body["type"] == "invalid_request_error"
    assert sweep.sent_to_engines(PATHS[endpoint]) == []


async def test_a_chat_with_an_image_reaches_a_kvgate_engine_as_the_client_wrote_it(sweep: Sweep) -> None:
    # The gateway renders only a chat's text (it cannot tell what an image becomes): a kvgate engine, which
    # prefers the gateway's ids to the messages, must not be sent those ids as the prompt, nor any route
    # predict cached tokens of a prompt it did not render.
    sweep.forget()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it"}, image]}]
    status, _, headers = await sweep.cluster.post(
        "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2}
    )
    [body] = sweep.sent_to_engines("/v1/chat/completions")
    assert body["messages"] == messages
    assert not {"prompt_token_ids", "prompt_token_ids_hex", "cache_shared_blocks"} & body.keys()
    assert status == 400  # (kvgate's engines read text only: the engine's own refusal)
    assert headers["x-kvgate-predicted-cached-tokens"] == "0"


async def test_a_conversation_to_embed_with_an_image_reaches_the_engine(sweep: Sweep) -> None:
    # vLLM's chat form of an embeddings request (messages), with media: counted by its text, forwarded.
    sweep.forget()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it"}, image]}]
    status, answer, _ = await sweep.cluster.post("/v1/embeddings", {"model": MODEL, "messages": messages})
    [body] = sweep.sent_to_engines("/v1/embeddings")
    assert body["messages"] == messages
    assert status == 400 and "image_url" in answer["error"]["message"]  # (the engine's own: it embeds text)
