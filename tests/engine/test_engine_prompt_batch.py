"""A completion naming several prompts (``prompt: ["a", "b"]`` or token-id lists) on kvgate's engine, served
as vLLM serves it (engine.completion_batch, engine.batch_serve): a request per prompt, all in the scheduler at
once, answers joined with choice index = prompt index x n + choice index, usage summed, one stream with one
usage chunk and one [DONE]; a prompt the engine refuses fails the batch before anything runs, and a client
that leaves aborts every prompt. Before, the engine answered every such body with a 400 ("only one prompt
per request is supported")."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine.engine_types import StepOutput
from engine.llm_engine import LLMEngine
from engine.server import EngineServer
from tests.engine.released import assert_released
from tests.engine.served_engine import served_engine
from tests.engine_process import engine_process

KV_BLOCKS = 512
BLOCK = 4


class Running:
    def __init__(self, server: EngineServer, url: str, session: aiohttp.ClientSession) -> None:
        self.server, self.url, self.session = server, url, session

    @property
    def llm(self) -> LLMEngine:
        assert self.server.llm is not None
        return self.server.llm

    async def post(self, body: dict[str, Any], **headers: str) -> tuple[int, Any, dict[str, str]]:
        full = {"model": self.server.model, **body}
        async with self.session.post(self.url + "/v1/completions", json=full, headers=headers) as r:
            return r.status, await r.json(content_type=None), {k.lower(): v for k, v in r.headers.items()}

    async def stream(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
        """The JSON chunks of a streamed answer, and its raw text."""
        full = {"model": self.server.model, "stream": True, **body}
        async with self.session.post(self.url + "/v1/completions", json=full) as r:
            assert r.status == 200, await r.text()
            raw = (await r.read()).decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        return [json.loads(e) for e in events if e != "[DONE]"], raw


async def running(model_dir: Path, kv_blocks: int, **config_fields: Any) -> AsyncIterator[Running]:
    fields = {"block_size": BLOCK, "num_kv_blocks": kv_blocks, **config_fields}
    async with served_engine(model_dir, **fields) as (server, url, session):
        yield Running(server, url, session)


@pytest.fixture
async def served(tiny_model_dir: Path) -> AsyncIterator[Running]:
    async for server in running(tiny_model_dir, KV_BLOCKS):
        yield server


@pytest.fixture
async def small(tiny_model_dir: Path) -> AsyncIterator[Running]:
    """An engine whose KV cache (16 blocks of 4) holds less than its context (256 tokens)."""
    async for server in running(tiny_model_dir, 16, max_model_len=256):
        yield server


def most_running(llm: LLMEngine) -> Callable[[], int]:
    """Wraps the engine's step: the most sequences its scheduler held running after any step since."""
    seen = [0]
    step = llm.step

    def counted() -> list[StepOutput]:
        outputs = step()
        seen[0] = max(seen[0], len(llm.scheduler.running))
        return outputs

    llm.step = counted  # type: ignore[method-assign]
    return lambda: seen[0]


PROMPTS = [list(range(10, 30)), list(range(40, 47)), list(range(60, 73))]


async def test_a_whole_batch_joins_the_prompts_answers_as_vllm_does(served: Running) -> None:
    singles = []
    for prompt in PROMPTS:
        status, single, _ = await served.post({"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert status == 200, single
        singles.append(single)
    # Each prompt is in the prefix cache now: its whole blocks but the last token's come back cached.
    status, answer, headers = await served.post(
        {"prompt": PROMPTS, "max_tokens": 4, "temperature": 0, "n": 2}, **{"x-request-id": "batch-7"}
    )
    assert status == 200, answer
    assert headers["x-request-id"] == "batch-7"
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    assert [c["index"] for c in answer["choices"]] == list(range(6))
    for i, single in enumerate(singles):  # greedy: each prompt's two choices are its single answer
        texts = [c["text"] for c in answer["choices"][2 * i : 2 * i + 2]]
        assert texts == [single["choices"][0]["text"]] * 2
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in PROMPTS) == 40
    assert usage["completion_tokens"] == 3 * 2 * 4 and usage["total_tokens"] == 40 + 24
    cached = sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS)
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached


async def test_text_prompts_get_their_special_tokens_and_one_element_lists_are_one_prompt(
    served: Running,
) -> None:
    texts = ["hello world", "the quick brown fox jumps"]
    counts = []
    for text in texts:
        _, single, _ = await served.post({"prompt": text, "max_tokens": 1})
        counts.append(single["usage"]["prompt_tokens"])
    status, answer, _ = await served.post({"prompt": texts, "max_tokens": 1})
    assert status == 200 and answer["usage"]["prompt_tokens"] == sum(counts)
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    status, one, _ = await served.post({"prompt": [texts[1]], "max_tokens": 1})
    assert status == 200 and len(one["choices"]) == 1 and one["usage"]["prompt_tokens"] == counts[1]


async def test_the_prompts_of_a_batch_run_side_by_side_in_the_scheduler(served: Running) -> None:
    most = most_running(served.llm)
    status, answer, _ = await served.post({"prompt": PROMPTS, "max_tokens": 30, "temperature": 0})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 3 * 30
    assert most() == len(PROMPTS)


async def test_a_streamed_batch_is_one_stream_with_one_usage_chunk_and_one_done(served: Running) -> None:
    body = {
        "prompt": PROMPTS,
        "max_tokens": 6,
        "n": 2,
        "temperature": 0,
        "logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    chunks, raw = await served.stream(body)
    assert raw.count("data: [DONE]") == 1 and raw.endswith("data: [DONE]\n\n")
    assert len({c["id"] for c in chunks}) == 1
    usage_chunks = [c for c in chunks if c.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1]["choices"] == []
    texts: dict[int, str] = {}
    tokens: dict[int, int] = {}
    finished = []
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["logprobs"] is not None:
                tokens[choice["index"]] = tokens.get(choice["index"], 0) + len(choice["logprobs"]["tokens"])
            if choice["finish_reason"] is not None:
                finished.append(choice["index"])
    assert sorted(finished) == list(range(6))
    assert tokens == dict.fromkeys(range(6), 6)  # every token's logprobs, under its choice's index
    _, whole, _ = await served.post({**body, "stream_options": None})
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    usage = chunks[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (40, 3 * 2 * 6)
    assert whole["usage"]["prompt_tokens"] == usage["prompt_tokens"]

    # Without include_usage: no usage chunk, one [DONE].
    chunks, raw = await served.stream({"prompt": ["a b", "c d"], "max_tokens": 2})
    assert '"usage"' not in raw and raw.count("data: [DONE]") == 1
    assert {ch["index"] for c in chunks for ch in c["choices"]} == {0, 1}


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([], "prompt must not be empty"),
        (["a"] * 129, "prompt holds 129 prompts; this engine takes at most 128"),
        (["a", ""], "prompt 1: the prompt must not be empty"),
        ([[1, 2], []], "prompt 1: the prompt must not be empty"),
        ([[1, 2], [3, 10**6]], "prompt 1: prompt holds token id 1000000, outside the model's vocabulary"),
        (["a", [1, 2]], "an array of strings"),
        ([[1, 2], "a"], "an array of arrays of token ids"),
        ([[1, 2], [3, [4]]], "integers"),
    ],
)
async def test_a_batch_with_a_bad_prompt_is_a_400_naming_prompt(
    served: Running, prompt: list[Any], says: str
) -> None:
    status, answer, _ = await served.post({"prompt": prompt, "max_tokens": 2})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
    assert says in error["message"], error


async def test_what_the_engine_refuses_for_one_prompt_fails_the_batch_before_anything_runs(
    small: Running,
) -> None:
    added: list[str] = []
    add = small.llm.add_request

    def recorded(request_id: str, *args: Any, **kwargs: Any) -> None:
        added.append(request_id)
        add(request_id, *args, **kwargs)

    small.llm.add_request = recorded  # type: ignore[method-assign]
    # 16 blocks of 4: 70 tokens of prompt and answer fit the model's context, never this cache.
    status, answer, _ = await small.post({"prompt": [[1, 2, 3], [4] * 60], "max_tokens": 10})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt 1: ")
    assert "needs 18 KV blocks; this engine has 16" in error["message"]
    assert added == []  # prompt 0 was never submitted
    # Past the model's context: refused as it is for one prompt, saying which.
    status, answer, _ = await small.post({"prompt": [[1], [4] * 10**5], "max_tokens": 1})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert answer["error"]["message"].startswith("prompt 1: This model's maximum context length")
    status, answer, _ = await small.post({"prompt": ["x", "y"], "temperature": 7})
    assert status == 400 and answer["error"]["param"] == "temperature"  # (not a prompt's fault: no prefix)
    body = {"prompt": ["x", "y"], "kv_transfer_params": {"prefill_url": "http://127.0.0.1:1"}}
    status, answer, _ = await small.post(body)
    assert status == 400 and answer["error"]["param"] == "kv_transfer_params"
    assert added == []


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_a_batch_aborts_every_prompt(served: Running, stream: bool) -> None:
    llm = served.llm
    most = most_running(llm)
    body = {
        "model": served.server.model,
        "prompt": PROMPTS,
        "max_tokens": 1500,
        "stream": stream,
        "ignore_eos": True,  # (a sampled EOS would end a prompt before the client leaves)
    }
    if stream:
        response = await served.session.post(served.url + "/v1/completions", json=body)
        await response.content.readany()
        response.close()
    else:
        request = asyncio.ensure_future(served.session.post(served.url + "/v1/completions", json=body))
        for _ in range(500):
            if most() == len(PROMPTS):
                break
            await asyncio.sleep(0.01)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    assert most() == len(PROMPTS)
    await assert_released(llm, served.session, served.url, polls=500)


def test_an_engine_core_process_serves_a_batch_and_refuses_one_as_the_engine_thread_does(
    tiny_model_dir: Path,
) -> None:
    # `kvgate engine`'s default: the prompts cross to a core process, which alone knows what it refuses.
    with engine_process(tiny_model_dir, kv_blocks=4, max_model_len=64, engine_core="process") as url:

        def post(body: dict[str, Any]) -> tuple[int, Any]:
            raw = json.dumps({"max_tokens": 2, **body}).encode()
            request = urllib.request.Request(
                url + "/v1/completions", raw, {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    return answer.status, json.loads(answer.read())
            except urllib.error.HTTPError as error:
                return error.code, json.loads(error.read())

        # ignore_eos: a sampled token of the random model is now and then its EOS (CI saw 7 of 8).
        status, answer = post({"prompt": [[5, 6, 7], [8, 9]], "n": 2, "ignore_eos": True})
        assert status == 200, answer
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
        assert answer["usage"]["prompt_tokens"] == 5 and answer["usage"]["completion_tokens"] == 8
        status, answer = post({"prompt": [[5, 6], [7] * 17]})  # 4 blocks of 4 hold 16 tokens
        assert status == 400, answer
        assert (
            answer["error"]["message"].startswith("prompt 1: ") and "KV blocks" in answer["error"]["message"]
        )
        for _ in range(100):
            with urllib.request.urlopen(url + "/health", timeout=60) as health:
                load = json.loads(health.read())["load"]
            if load["running"] == load["waiting"] == 0:
                break
            time.sleep(0.05)
        assert load["running"] == load["waiting"] == 0  # prompt 0 was aborted
