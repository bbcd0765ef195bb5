"""``POST /v1/embeddings`` through the gateway (gateway.embedding_inputs): the OpenAI SDK's
``embeddings.create``, admitted by the tokens the engine will count, routed to one engine, billed as a
request of prompt tokens only; inputs the engines would refuse, and binary answers, are refused first."""

from __future__ import annotations

import gzip
import threading
from pathlib import Path
from typing import Any

import numpy as np
import openai
import orjson
import pytest

from gateway.http.errors import InvalidRequest
from tests.client_request import BareRequest
from tests.harness import MODEL, Cluster, ClusterFactory
from tests.models import with_bos

PRICE = {"input": "0.50", "cached_input": "0.05", "output": "1.50"}


def words(tag: str, count: int = 60) -> str:
    return " ".join(f"{tag}-{i}" for i in range(count))


async def test_the_sdk_gets_embeddings_through_the_gateway_and_they_are_billed(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster({"eu-west": 2}, prices={MODEL: PRICE})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    texts = [words("doc0"), words("doc1", 20), "a short one"]
    # (The SDK asks for base64 unless told otherwise, and decodes it.)
    answer = await client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in answer.data] == [0, 1, 2]
    assert all(len(d.embedding) == 64 for d in answer.data)
    floats = await client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for a, b in zip(answer.data, floats.data, strict=True):
        assert np.allclose(a.embedding, b.embedding, atol=1e-6)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0
    await client.close()

    status, body, headers = await cluster.post(
        "/v1/embeddings", {"model": MODEL, "input": texts}, headers={"x-request-id": "emb-1"}
    )
    assert status == 200, body
    assert headers["x-request-id"] == "emb-1" and "," not in headers["x-kvgate-engine"]
    assert headers["x-kvgate-predicted-cached-tokens"] == "0"
    await cluster.gateway.billing.writer.flush()
    records = [r for r in await cluster.gateway.billing.ledger.records() if r.request_id == "emb-1"]
    assert len(records) == 1
    record = records[0]
    assert (record.status, record.prompt_tokens, record.completion_tokens) == (
        "completed",
        body["usage"]["prompt_tokens"],
        0,
    )
    assert body["usage"]["cost"] == pytest.approx(record.cost_picodollars / 10**12, rel=1e-12)
    assert record.cost_picodollars == record.prompt_tokens * 500_000  # $0.50 per million input tokens


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tokenizer that adds a BOS to a text, as Llama's does (scripts/test-vllm's)."""
    return with_bos(tiny_model_dir, tmp_path_factory.mktemp("bos") / "tiny-bos")


async def counted(cluster: Cluster, body: dict[str, Any]) -> int:
    """The prompt tokens the gateway admits an embeddings request for."""
    prepared = await cluster.gateway.prepare.embeddings(BareRequest(), body)
    return prepared.prompt_tokens


async def embedded_as_counted(make_cluster: ClusterFactory, model_dir: Path, extra: dict[str, Any]) -> Any:
    """The answer of kvgate's engine (on ``model_dir``) to an embeddings request of ``extra``, through the
    gateway, having checked that the gateway admitted it for the prompt tokens the engine reports."""
    cluster = await make_cluster({"eu-west": 1}, real_model=model_dir, tokenizer=str(model_dir))
    body = {"model": cluster.model, "encoding_format": "float", **extra}
    status, answer, _ = await cluster.post("/v1/embeddings", body)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == await counted(cluster, body)
    return answer


@pytest.mark.parametrize(
    "extra",
    [
        {"input": "one text, with a BOS added as vLLM adds it"},
        {"input": [words("a", 30), "two", words("c", 5)]},
        {"input": [words("a", 30), "two"], "add_special_tokens": False},
        {"input": [5, 6, 7, 8, 9]},
        {"input": [[5, 6, 7], [8, 9], [10]]},
        {"input": [words("a", 30), words("b", 40)], "truncate_prompt_tokens": 7},
        {"input": [words("a", 30)], "truncate_prompt_tokens": 7, "truncation_side": "left"},
        {"input": "a text", "messages": None},  # (null is absent: it was refused as both forms at once)
    ],
    ids=["text", "texts", "no-special", "ids", "id-lists", "truncated", "truncated-left", "null-messages"],
)
async def test_the_gateway_counts_the_tokens_kvgates_engine_reports(
    make_cluster: ClusterFactory, bos_model_dir: Path, extra: dict[str, Any]
) -> None:
    answer = await embedded_as_counted(make_cluster, bos_model_dir, extra)
    inputs = extra["input"]
    count = 1 if isinstance(inputs, str) or isinstance(inputs[0], int) else len(inputs)
    assert [d["index"] for d in answer["data"]] == list(range(count))
    vectors = np.array([d["embedding"] for d in answer["data"]])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)  # (vLLM's pooler normalises)


CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": words("q", 10)}]
OTHER = [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]


@pytest.mark.parametrize(
    "extra",
    [
        {"messages": CONVERSATION},
        {"input": CONVERSATION},
        {"messages": [CONVERSATION, OTHER]},
        {"input": [CONVERSATION, OTHER]},
        {"messages": CONVERSATION, "add_generation_prompt": True},
        {"messages": CONVERSATION, "continue_final_message": True},
        {"messages": CONVERSATION, "add_special_tokens": True},
        {"input": [CONVERSATION, OTHER], "truncate_prompt_tokens": 9},
        {"messages": CONVERSATION, "add_generation_prompt": None},  # (null: the default, false)
    ],
    ids=["messages", "input", "messages-batch", "input-batch", "generation-prompt", "continue", "special",
         "truncated", "null-generation-prompt"],
)  # fmt: skip
async def test_the_gateway_counts_a_conversations_tokens_as_kvgates_engine_reports_them(
    make_cluster: ClusterFactory, bos_model_dir: Path, extra: dict[str, Any]
) -> None:
    # kvgate's engine refused every chat form with a 400; it now embeds them as vLLM 0.32 does.
    answer = await embedded_as_counted(make_cluster, bos_model_dir, extra)
    conversations = extra.get("messages", extra.get("input"))
    assert isinstance(conversations, list)
    count = 1 if isinstance(conversations[0], dict) else len(conversations)
    assert [d["index"] for d in answer["data"]] == list(range(count))


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format", "through this gateway"),
        ({"input": ""}, "input", "empty string"),
        ({"input": []}, "input", "must be a non-empty string"),
        ({"input": ["fine", ""]}, "input", "input.1 must not be an empty string"),
        ({}, "input", "field required"),
        ({"input": "x", "messages": [{"role": "user", "content": "y"}]}, "messages", "not both"),
        ({"input": [1, 2**32]}, "input", "token ids must be integers"),
        ({"input": ["text", [1, 2]], "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": [True]}, "input", "each of input's items"),
        ({"messages": [[{"role": "user", "content": "a"}], "b"]}, "messages", "each of messages's items"),
        ({"input": [[{"role": "user", "content": "a"}], [{"role": "bot", "content": "b"}]]}, "input.1.0.role",
         "input.1.0.role"),
    ],
    ids=["bytes", "empty", "empty-list", "empty-item", "missing", "both", "big-id", "dimensions", "bool",
         "mixed-conversations", "bad-role"],
)  # fmt: skip
async def test_inputs_the_engines_would_refuse_are_refused_with_the_field_named(
    make_cluster: ClusterFactory, body: dict[str, Any], param: str, says: str
) -> None:
    cluster = await make_cluster({"eu-west": 1})
    status, answer, headers = await cluster.post("/v1/embeddings", {"model": MODEL, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param and says in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error" and headers["x-request-id"]


async def test_the_count_of_inputs_is_bounded_before_they_are_read(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1}, max_embedding_inputs=4, max_messages=5)
    status, answer, _ = await cluster.post("/v1/embeddings", {"model": MODEL, "input": ["x"] * 5})
    assert status == 400 and "at most 4" in answer["error"]["message"]
    three = [{"role": "user", "content": "x"}] * 3
    for body in ({"messages": three * 2}, {"input": [three, three]}):
        status, answer, _ = await cluster.post("/v1/embeddings", {"model": MODEL, **body})
        assert status == 400 and "6 messages in all" in answer["error"]["message"], answer
    status, answer, _ = await cluster.post("/v1/embeddings", {"model": MODEL, "input": list(range(1, 50))})
    assert status == 200, answer  # (one prompt of 49 token ids, whatever the bound on inputs)
    status, answer, _ = await cluster.post("/v1/embeddings", {"model": "no-such-model", "input": "x"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"


async def test_conversations_are_bounded_by_content_parts_as_a_chat_is(make_cluster: ClusterFactory) -> None:
    # A chat's content parts are bounded (max_content_parts) before they are validated and rendered; an
    # embeddings request's conversations were not: one message of 300,000 parts (8 MB) took 1.2 s to read.
    cluster = await make_cluster({"eu-west": 1}, max_content_parts=5)
    parts = [{"type": "text", "text": "a"}] * 3
    message = {"role": "user", "content": parts}
    for body in ({"messages": [message, message]}, {"input": [[message], [message]]}):
        with pytest.raises(InvalidRequest, match="6 content parts in all") as refused:
            await cluster.gateway.prepare.embeddings(BareRequest(), {"model": MODEL, **body})
        assert refused.value.param == next(iter(body))
    assert await counted(cluster, {"model": MODEL, "messages": [message]}) > 0


async def test_a_conversation_is_counted_as_its_chat_template_renders_it(
    make_cluster: ClusterFactory, bos_model_dir: Path
) -> None:
    cluster = await make_cluster({"eu-west": 1}, real_model=bos_model_dir, tokenizer=str(bos_model_dir))
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": words("q", 10)}]
    prepare = cluster.gateway.prepare
    rendered = prepare._render(cluster.model, {"messages": conversation, "add_generation_prompt": False})
    one = await counted(cluster, {"model": cluster.model, "messages": conversation})
    assert one == len(prepare.tokenizer.encode(rendered))  # (no BOS added: the template writes its own)
    assert await counted(cluster, {"model": cluster.model, "input": [conversation, conversation]}) == 2 * one
    with_prompt = await counted(
        cluster, {"model": cluster.model, "messages": conversation, "add_generation_prompt": True}
    )
    assert with_prompt > one


class _ThreadNoting:
    """A tokenizer that notes the thread each batch of an embeddings request's texts is encoded on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.threads: list[threading.Thread] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode_many(self, texts: list[str]) -> Any:
        self.threads.append(threading.current_thread())
        return self.inner.encode_many(texts)


async def test_a_compressed_body_is_read_off_the_event_loop(make_cluster: ClusterFactory) -> None:
    # 400 kB of token ids in 1 kB of gzip: its size on the wire said nothing of the work, and the million ids
    # such a body can hold were read and counted on the event loop (about 7x the time of the same body sent
    # uncompressed, which goes to a thread), every other request waiting meanwhile.
    cluster = await make_cluster({"eu-west": 1})
    prepare = cluster.gateway.prepare
    tokenizer = prepare.tokenizer = _ThreadNoting(prepare.tokenizer)
    packed = gzip.compress(orjson.dumps({"model": MODEL, "input": [7] * 200_000}))
    request = BareRequest(headers={"Content-Encoding": "gzip"}, content_length=len(packed))
    body = orjson.loads(gzip.decompress(packed))
    assert (await prepare.embeddings(request, body)).prompt_tokens == 200_000
    assert tokenizer.threads and threading.main_thread() not in tokenizer.threads
