"""The gateway in front of kvgate's real engine (a tiny random model): a conversation hits the cache."""

from __future__ import annotations

from pathlib import Path

from cache.chat_template import render_messages
from gateway.tenancy.tenants import create_key
from tests.harness import ClusterFactory


async def test_a_two_turn_conversation_reports_cached_tokens(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    cluster = await make_cluster({"eu-west": 2}, real_model=tiny_model_dir, tokenizer=str(tiny_model_dir))
    session = {"x-session-affinity": "real-conversation"}
    turn1 = [
        {"role": "system", "content": "the quick brown fox jumps over the lazy dog " * 8},
        {"role": "user", "content": "hello world"},
    ]
    body = {"model": cluster.model, "messages": turn1, "max_tokens": 6, "temperature": 0}
    status, first, headers1 = await cluster.post("/v1/chat/completions", body, headers=session)
    assert status == 200, first
    prompt1 = first["usage"]["prompt_tokens"]
    answer = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "and again"}]
    status, second, headers2 = await cluster.post(
        "/v1/chat/completions", {**body, "messages": turn2}, headers=session
    )
    assert status == 200, second
    assert (
        headers2["x-kvgate-engine"] == headers1["x-kvgate-engine"] and headers2["x-kvgate-route"] == "session"
    )
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (prompt1 // 16) * 16 > 0
    assert int(headers2["x-kvgate-predicted-cached-tokens"]) >= (prompt1 // 16) * 16


async def test_tenants_share_only_the_declared_public_prefix_on_the_real_engine(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    system = "the quick brown fox jumps over the lazy dog " * 8
    cluster = await make_cluster(
        {"eu-west": 1},
        real_model=tiny_model_dir,
        tokenizer=str(tiny_model_dir),
        auth={"enabled": True},
        tenants={"acme": {}, "globex": {}},
        shared_prefixes=[system],
    )
    keys = {t: (await create_key(cluster.gateway.billing.keys, t))[0] for t in ("acme", "globex")}
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "a question of acme " * 4}]
    body = {"model": cluster.model, "messages": messages, "max_tokens": 2, "temperature": 0}

    async def cached(tenant: str) -> tuple[int, int]:
        status, answer, _ = await cluster.post(
            "/v1/chat/completions", body, headers={"Authorization": f"Bearer {keys[tenant]}"}
        )
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"], answer["usage"]["prompt_tokens"]

    assert (await cached("acme"))[0] == 0
    acme_again, prompt = await cached("acme")
    assert acme_again == prompt // 16 * 16 - (16 if prompt % 16 == 0 else 0)
    prepare = cluster.gateway.prepare
    tokens = prepare.tokenizer.encode(render_messages(prepare.tokenizer, messages))
    public_tokens = prepare._shared_tokens(tokens) // 16 * 16
    globex, _ = await cached("globex")
    assert 0 < globex == public_tokens < acme_again  # the system prompt, not acme's question
