"""KV pulls between simulated engines over real HTTP: a pull, a failed one, and the endpoint's checks."""

from __future__ import annotations

import socket

from cache.hashing import block_hashes, namespace_seed
from cache.tokens import ByteTokenizer
from engine.openai_errors import MAX_BODY_BYTES
from tests.engine.sim_nodes import BS, StartSim, text_of


async def test_a_pull_takes_a_peers_prefix_and_the_peer_gives_it_up_first(start_sim: StartSim) -> None:
    source, target = await start_sim(engine_id="src"), await start_sim(engine_id="dst")
    prompt = text_of(100)
    await source.complete({"prompt": prompt, "max_tokens": 1})
    await source.complete({"prompt": text_of(40, salt="other "), "max_tokens": 1})  # used after it
    pull = {"pull_url": source.url, "pull_engine": "src", "pull_tokens": 96}
    body = await target.complete({"prompt": prompt + "!", "max_tokens": 2, "kv_transfer_params": pull})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 6 blocks, none computed here
    assert target.engine.counters.kv_pulls["ok"] == 1 and target.engine.counters.kv_pulled_tokens == 96
    assert source.engine.counters.kv_pull_served_tokens == 96
    # The six sent blocks are the source's next victims, the last of them first.
    seed = namespace_seed("kvgate-sim", "")
    sent = block_hashes(ByteTokenizer().encode(prompt), BS, seed)[:6]
    assert source.engine.cache.lru_order()[:6] == sent[::-1]
    # Our own cache now covers those blocks: a second pull asks for nothing.
    again = await target.complete({"prompt": prompt + "?", "max_tokens": 2, "kv_transfer_params": pull})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert source.engine.counters.kv_pull_served == 1


async def test_a_pull_that_fails_only_costs_the_computation(start_sim: StartSim) -> None:
    target = await start_sim()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    pull = {"pull_url": dead, "pull_tokens": 64}
    body = await target.complete({"prompt": text_of(100), "max_tokens": 2, "kv_transfer_params": pull})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert target.engine.counters.kv_pulls["failed"] == 1


async def test_kv_cached_refuses_what_it_cannot_answer(start_sim: StartSim) -> None:
    sim = await start_sim()
    good = {"model": "kvgate-sim", "prompt_token_ids": [1, 2, 3], "from_position": 0, "block_size": BS}
    for change, status, param in (
        ({"model": "nope"}, 404, "model"),
        ({"block_size": 8}, 400, "block_size"),
        ({"from_position": 3}, 400, "from_position"),
        ({"prompt_token_ids": []}, 400, "prompt_token_ids"),
    ):
        got, body, _ = await sim.post("/v1/kv/cached", {**good, **change})
        assert got == status and body["error"]["param"] == param, body


async def test_kv_cached_refuses_a_prompt_longer_than_the_context(start_sim: StartSim) -> None:
    # Millions of ids were converted and hashed on the event loop, holding up every request of the engine.
    sim = await start_sim()
    limit = sim.engine.config.max_model_len
    ids = [1] * (limit + 1)
    body = {"model": "kvgate-sim", "prompt_token_ids": ids, "from_position": 0, "block_size": BS}
    got, answer, _ = await sim.post("/v1/kv/cached", body)
    assert got == 400, answer
    error = answer["error"]
    assert error["param"] == "prompt_token_ids" and error["code"] == "context_length_exceeded"
    assert str(limit) in error["message"]
    fits = {**body, "prompt_token_ids": ids[:limit]}
    async with sim.session.post(f"{sim.url}/v1/kv/cached", json=fits) as r:
        assert r.status == 200  # the context itself is served


async def test_a_body_over_the_limit_is_a_json_413_on_every_post_route(start_sim: StartSim) -> None:
    # aiohttp's own 413 was text/plain on the routes that read the body themselves: a peer's importer or a
    # router's tokenizer client got a body it could not read as the error it is.
    sim = await start_sim()
    too_big = b" " * (MAX_BODY_BYTES + 1)
    for path in ("/v1/kv/cached", "/tokenize", "/v1/completions"):
        async with sim.session.post(f"{sim.url}{path}", data=too_big) as resp:
            assert (resp.status, resp.content_type) == (413, "application/json"), path
            assert str(MAX_BODY_BYTES) in (await resp.json())["error"]["message"]
