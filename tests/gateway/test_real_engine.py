"""The gateway in front of kvgate's real engine (a tiny random model): a conversation hits the cache."""

from __future__ import annotations

from pathlib import Path

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
