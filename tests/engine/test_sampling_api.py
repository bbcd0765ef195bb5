"""The sampling parameters over the engine's OpenAI API: parsed and checked, honoured (n choices, logprobs in
whole and streamed answers, ignore_eos, logit_bias), or refused with a 400 whose ``param`` names them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from cache.tokens import ByteTokenizer
from engine.engine_types import StepOutput, TokenLogprob
from engine.llm_engine import EngineConfig, LLMEngine
from engine.openai_api import GenerationRequest, RequestKind, parse_request
from engine.openai_choices import StreamAnswer
from engine.openai_errors import OpenAIError
from engine.openai_sampling import FULL, PLAIN, Capabilities
from engine.server import ENGINE_SERVER, build_app
from engine.server import ServerConfig as EngineServerConfig
from tests.serving import serve

# ------------------------------------------------------------------------------------------- parsing


def parse(
    body: dict[str, Any], kind: RequestKind = "completion", caps: Capabilities = FULL
) -> GenerationRequest:
    raw = orjson.dumps(body)
    return parse_request(
        raw, kind, served_model="m", tokenizer=ByteTokenizer(), capabilities=caps, vocab_size=300
    )


def refused(body: dict[str, Any], kind: RequestKind = "completion", caps: Capabilities = FULL) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body, kind, caps)
    assert (info.value.status, info.value.error_type) == (400, "invalid_request_error")
    return info.value


def test_every_sampling_field_reaches_the_params() -> None:
    req = parse(
        {
            "prompt": "x",
            "max_tokens": 9,
            "n": 3,
            "seed": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 7,
            "min_p": 0.05,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"12": 100, "7": -100.0},
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [3, 4],
            "stop": "END",
            "logprobs": 2,
        }
    )
    p = req.params
    assert (req.n, p.max_tokens, p.seed, p.temperature, p.top_p, p.top_k, p.min_p) == (
        3,
        9,
        5,
        0.5,
        0.9,
        7,
        0.05,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.logit_bias, p.min_tokens, p.ignore_eos, p.stop_token_ids) == (
        ((12, 100.0), (7, -100.0)),
        2,
        True,
        (3, 4),
    )
    assert (p.stop, p.logprobs) == (("END",), 2)
    assert [req.choice_params(i).seed for i in range(3)] == [5, 6, 7]  # distinct, reproducible choices


def test_chat_logprobs_take_top_logprobs() -> None:
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse({**chat, "logprobs": True, "top_logprobs": 4}, "chat").params.logprobs == 4
    assert parse({**chat, "logprobs": True}, "chat").params.logprobs == 0
    assert parse({**chat, "logprobs": False}, "chat").params.logprobs is None
    assert parse({"prompt": "x", "logprobs": 0}).params.logprobs == 0


@pytest.mark.parametrize(
    ("body", "kind", "param"),
    [
        ({"n": 0}, "completion", "n"),
        ({"n": 129}, "completion", "n"),
        ({"n": True}, "completion", "n"),
        ({"best_of": 2}, "completion", "best_of"),
        ({"echo": True}, "completion", "echo"),
        ({"suffix": "tail"}, "completion", "suffix"),
        ({"use_beam_search": True}, "completion", "use_beam_search"),
        ({"length_penalty": 0.5}, "completion", "length_penalty"),
        ({"prompt_logprobs": 1}, "completion", "prompt_logprobs"),
        ({"include_stop_str_in_output": True}, "completion", "include_stop_str_in_output"),
        ({"skip_special_tokens": False}, "completion", "skip_special_tokens"),
        ({"allowed_token_ids": [1]}, "completion", "allowed_token_ids"),
        ({"bad_words": ["x"]}, "completion", "bad_words"),
        ({"guided_json": {}}, "completion", "guided_json"),
        ({"response_format": {"type": "json_object"}}, "chat", "response_format"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "completion",
            "stream_options.continuous_usage_stats",
        ),
        ({"logprobs": 6}, "completion", "logprobs"),
        ({"logprobs": True}, "completion", "logprobs"),
        ({"logprobs": 1}, "chat", "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "chat", "top_logprobs"),
        ({"top_logprobs": 2}, "chat", "top_logprobs"),  # without logprobs: true
        ({"min_p": 1.5}, "completion", "min_p"),
        ({"presence_penalty": 2.5}, "completion", "presence_penalty"),
        ({"frequency_penalty": "high"}, "completion", "frequency_penalty"),
        ({"repetition_penalty": 0}, "completion", "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "completion", "logit_bias"),
        ({"logit_bias": {"x": 1}}, "completion", "logit_bias"),
        ({"logit_bias": {"300": 1}}, "completion", "logit_bias"),  # outside the vocabulary
        ({"logit_bias": [1]}, "completion", "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 5}, "completion", "min_tokens"),
        ({"min_tokens": -1}, "completion", "min_tokens"),
        ({"ignore_eos": "yes"}, "completion", "ignore_eos"),
        ({"stop_token_ids": [1, -1]}, "completion", "stop_token_ids"),
        ({"stop_token_ids": [300]}, "completion", "stop_token_ids"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(
    body: dict[str, Any], kind: RequestKind, param: str
) -> None:
    base = {"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"}
    assert refused({**base, **body}, kind).param == param


def test_an_engine_without_choices_or_logprobs_refuses_them() -> None:
    # The simulator's capabilities: only n = 1 and no logprobs, as before.
    assert refused({"prompt": "x", "n": 2}, caps=PLAIN).param == "n"
    assert refused({"prompt": "x", "logprobs": 1}, caps=PLAIN).param == "logprobs"
    chat = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 1}
    assert refused(chat, "chat", caps=PLAIN).param == "top_logprobs"
    assert parse({"prompt": "x", "n": 1, "logprobs": None}, caps=PLAIN).n == 1


# -------------------------------------------------------------------------------------------- served


class Served:
    def __init__(self, url: str, session: aiohttp.ClientSession, engine: LLMEngine, model: str) -> None:
        self.url, self.session, self.engine, self.model = url, session, engine, model

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.session.post(self.url + path, json={"model": self.model, **body}) as r:
            return r.status, await r.json(content_type=None)

    async def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        async with self.session.post(
            self.url + path, json={"model": self.model, "stream": True, **body}
        ) as r:
            assert r.status == 200, await r.text()
            raw = (await r.read()).decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]


@pytest.fixture
async def served(tiny_model_dir: Path) -> AsyncIterator[Served]:
    engine = LLMEngine(EngineConfig(str(tiny_model_dir), block_size=4, num_kv_blocks=512, device="cpu"))
    app = build_app(engine, EngineServerConfig(engine_id="test/sampling"))
    runner = web.AppRunner(app, handler_cancellation=True)
    url = await serve(runner)
    async with aiohttp.ClientSession() as session:
        yield Served(url, session, engine, app[ENGINE_SERVER].model)
    await runner.cleanup()


CHAT = {"messages": [{"role": "user", "content": "tell me"}]}


async def test_n_gives_n_choices_each_with_its_index(served: Served) -> None:
    counters = served.engine.counters
    body = {
        "prompt": "x",
        "prompt_token_ids": list(range(20, 33)),
        "max_tokens": 5,
        "n": 3,
        "seed": 1,
        "ignore_eos": True,
    }
    status, whole = await served.post("/v1/completions", body)
    assert status == 200, whole
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in whole["choices"])
    assert whole["usage"]["completion_tokens"] == 15 and whole["usage"]["prompt_tokens"] == 13
    assert len({c["text"] for c in whole["choices"]}) > 1  # seed, seed + 1, seed + 2: different draws
    # Choices 1 and 2 start once choice 0 has computed the prompt: they find its 3 full blocks cached.
    assert counters.cached_prompt_tokens == 2 * 12
    _, again = await served.post("/v1/completions", body)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in whole["choices"]]
    assert served.engine.blocks.num_free == served.engine.blocks.num_blocks  # nothing left running


async def test_n_streams_every_choice_and_finishes_each(served: Served) -> None:
    chunks = await served.stream(
        "/v1/chat/completions",
        {**CHAT, "max_tokens": 4, "n": 2, "ignore_eos": True, "stream_options": {"include_usage": True}},
    )
    roles = [
        c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")
    ]
    assert roles == [0, 1]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def check_chat_entry(entry: dict[str, Any], k: int) -> None:
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and entry["logprob"] <= 0
    assert entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == k
    tops = [t["logprob"] for t in entry["top_logprobs"]]
    assert tops == sorted(tops, reverse=True) and entry["logprob"] <= tops[0] + 1e-6


async def test_chat_logprobs_whole_and_streamed(served: Served) -> None:
    body = {
        **CHAT,
        "max_tokens": 5,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
        "temperature": 0,
    }
    status, whole = await served.post("/v1/chat/completions", body)
    assert status == 200, whole
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        check_chat_entry(entry, 3)
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])  # greedy takes the best
    chunks = await served.stream("/v1/chat/completions", body)
    streamed = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content])


async def test_completion_logprobs_whole_and_streamed(served: Served) -> None:
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True, "logprobs": 2, "seed": 9}
    status, whole = await served.post("/v1/completions", body)
    assert status == 200, whole
    lp = whole["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert 1 <= len(top) <= 3 and top[token] == pytest.approx(logprob)  # the top 2 and the chosen one
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    chunks = await served.stream("/v1/completions", body)
    tokens = [
        t
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for t in c["choices"][0]["logprobs"]["tokens"]
    ]
    assert tokens == lp["tokens"]
    plain = await served.stream("/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert all(c["choices"][0]["logprobs"] is None for c in plain if c["choices"])


async def test_ignore_eos_and_logit_bias_over_http(served: Served) -> None:
    eos = str(min(served.engine.eos_token_ids))
    body = {"prompt": "hello", "max_tokens": 5, "temperature": 0, "logit_bias": {eos: 100}}
    _, stopped = await served.post("/v1/completions", body)
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    _, ignored = await served.post("/v1/completions", {**body, "ignore_eos": True})
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 5
    _, held = await served.post("/v1/completions", {**body, "min_tokens": 3})
    assert held["usage"]["completion_tokens"] == 4 and held["choices"][0]["finish_reason"] == "stop"


async def test_refusals_over_http_name_the_field(served: Served) -> None:
    for body, param in (
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": "x", "n": 1000}, "n"),
    ):
        status, error = await served.post("/v1/completions", body)
        assert (
            status == 400
            and error["error"]["param"] == param
            and error["error"]["type"] == "invalid_request_error"
        )


async def test_a_client_leaving_aborts_every_choice(served: Served) -> None:
    body = {"model": served.model, **CHAT, "max_tokens": 3000, "n": 3, "ignore_eos": True, "stream": True}
    response = await served.session.post(served.url + "/v1/chat/completions", json=body)
    await response.content.readany()
    response.close()
    engine = served.engine
    for _ in range(300):
        if not engine.scheduler.has_work():
            break
        await asyncio.sleep(0.02)
    assert not engine.scheduler.has_work() and engine.blocks.num_free == engine.blocks.num_blocks
    assert not engine.sampler._states


def test_logprobs_of_held_back_text_go_out_with_the_text_or_the_finish() -> None:
    req = parse({"messages": [{"role": "user", "content": "x"}], "stream": True, "logprobs": True}, "chat")
    answer = StreamAnswer(req, ByteTokenizer())

    def out(text: str, token: int, finished: bool = False) -> StepOutput:
        lp = (TokenLogprob(token, -0.5),)
        return StepOutput("r", text, (token,), finished, "stop" if finished else None, 1, 0, 1, 0, lp)

    assert answer.chunk(0, out("", 0xC3)) == b""  # half a character: nothing to send yet
    [chunk] = [
        json.loads(c.removeprefix(b"data: ")) for c in answer.chunk(0, out("é", 0xA9)).split(b"\n\n") if c
    ]
    assert [e["token"] for e in chunk["choices"][0]["logprobs"]["content"]] == ["\ufffd", "\ufffd"]
    [final] = [
        json.loads(c.removeprefix(b"data: ")) for c in answer.chunk(0, out("", 7, True)).split(b"\n\n") if c
    ]
    assert final["choices"][0]["finish_reason"] == "stop"
    assert [e["token"] for e in final["choices"][0]["logprobs"]["content"]] == ["\x07"]
    plain = StreamAnswer(parse({"prompt": "x", "stream": True}), ByteTokenizer())
    [end] = [
        json.loads(c.removeprefix(b"data: ")) for c in plain.chunk(0, out("", 7, True)).split(b"\n\n") if c
    ]
    assert end["choices"][0]["logprobs"] is None
