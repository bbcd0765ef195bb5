"""vLLM/SGLang KV events: decoding both encodings (and SGLang's shapes, from its source), rejecting
malformed payloads, and translating engine block ids into kvgate's contract-1 hashes, never a wrong one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cache.events import AllCleared, BlockRemoved, BlockStored, EventDecodeError, KvEvent
from cache.foreign_chain import ForeignChain
from cache.foreign_events import (
    ForeignCleared,
    ForeignRemoved,
    ForeignStored,
    decode_foreign_batch,
)
from cache.hashing import block_hashes, namespace_seed
from tests import vllm_publisher as vp
from tests.memory import bytes_kept

BS = 16
MODEL = "m"


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def kv(tokens_: list[int], *, name: str = MODEL, salt: str = "") -> list[int]:
    return block_hashes(tokens_, BS, namespace_seed(name, salt))


def stored_hashes(events: list[KvEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed_hashes(events: list[KvEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


# -- decoding ------------------------------------------------------------------------------------------


def test_decodes_vllm_map_encoding_with_omitted_defaults() -> None:
    payload = vp.encode_batch(
        [
            vp.BlockStored([2**64 - 1, 7], None, tokens(2), BS, extra_keys=[("salt-a",), None]),
            vp.BlockRemoved([7]),
            vp.AllBlocksCleared(),
        ],
        ts=12.5,
        data_parallel_rank=3,
        encoding="map",
    )
    batch = decode_foreign_batch(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 3
    stored, removed, cleared = batch.events
    assert isinstance(stored, ForeignStored)
    assert stored.block_hashes == (2**64 - 1, 7) and stored.parent is None
    assert list(stored.token_ids or []) == tokens(2) and stored.block_size == BS
    assert stored.medium == "GPU" and stored.group_idx == 0 and stored.lora_name is None
    assert stored.extra_keys == (("salt-a",), None)
    assert isinstance(removed, ForeignRemoved) and removed.block_hashes == (7,) and removed.medium == "GPU"
    assert isinstance(cleared, ForeignCleared)

    # A map that leaves out every field with a default (parent, medium, lora, extra keys, group).
    minimal = msgpack.packb(
        [1.0, [{"type": "BlockStored", "block_hashes": [5], "token_ids": tokens(1), "block_size": BS}]]
    )
    (event,) = decode_foreign_batch(minimal).events
    assert isinstance(event, ForeignStored)
    assert event.parent is None and event.medium is None and event.group_idx is None
    assert event.extra_keys is None


def test_skips_event_types_it_does_not_know_and_fields_it_does_not_know() -> None:
    """A newer vLLM adds event types and trailing fields: the known events of the batch still decode."""
    payload = msgpack.packb(
        [1.0, [
            {"type": "BlockPinned", "block_hashes": [5], "until": 3},
            {"type": "BlockStored", "block_hashes": [5], "token_ids": tokens(1), "block_size": BS,
             "kv_cache_spec_kind": "full", "session_id": "s", "locality": {"node": 1}},
            ["BlockMoved", [5], "CPU"],
            ["BlockRemoved", [5], "GPU", 0, "trailing", {"more": 1}],
        ], 0]
    )  # fmt: skip
    batch = decode_foreign_batch(payload)
    stored, removed = batch.events
    assert isinstance(stored, ForeignStored) and stored.block_hashes == (5,)
    assert isinstance(removed, ForeignRemoved) and removed.block_hashes == (5,) and removed.group_idx == 0
    assert batch.unknown_events == ("BlockPinned", "BlockMoved")


def test_a_batch_with_fields_after_the_rank_decodes() -> None:
    """msgspec appends a field a newer engine adds to its array_like EventBatch after the rank."""
    payload = msgpack.packb([1.0, [["AllBlocksCleared"]], 2, "later", {"x": 1}])
    batch = decode_foreign_batch(payload)
    assert batch.data_parallel_rank == 2 and batch.events == (ForeignCleared(),)


def test_decodes_vllm_positional_encoding_both_lengths() -> None:
    payload = vp.encode_batch(
        [vp.BlockStored([1, 2], None, tokens(2), BS, lora_name="ad", lora_id=4), vp.BlockRemoved([2])],
        ts=1.0,
        data_parallel_rank=0,
        encoding="positional",
    )
    stored, removed = decode_foreign_batch(payload).events
    assert isinstance(stored, ForeignStored) and stored.lora_name == "ad" and stored.lora_id == 4
    assert isinstance(removed, ForeignRemoved) and removed.block_hashes == (2,)
    # Older vLLM: [tag, hashes, parent, tokens, block_size, lora_id] and [tag, hashes] only.
    old = msgpack.packb([1.0, [["BlockStored", [9], 1, tokens(1), BS, None], ["BlockRemoved", [9]]]])
    stored, removed = decode_foreign_batch(old).events
    assert isinstance(stored, ForeignStored) and stored.parent == 1 and stored.medium is None
    assert isinstance(removed, ForeignRemoved) and removed.medium is None


def test_decodes_sglang_shapes() -> None:
    """From sglang/srt/disaggregation/kv_events.py: array_like events [tag, hashes, parent, tokens,
    block_size, lora_id, medium], BlockStoredWithMetadata appending {"cache_salt": ...}, signed int64
    hashes, StorageMedium values, and batches with or without attn_dp_rank."""
    salted = ["BlockStored", [-(2**63)], None, [1, 2], 2, None, "GPU", {"cache_salt": "t1"}]
    host = ["BlockStored", [-5], -(2**63), [3, 4], 2, None, "CPU_PINNED"]
    bigram = ["BlockStored", [6], None, [[1, 2], [2, 3]], 2, None, "GPU"]
    batch = decode_foreign_batch(
        msgpack.packb([3.0, [salted, host, bigram, ["BlockRemoved", [-5], "GPU"], ["AllBlocksCleared"]]])
    )
    assert batch.data_parallel_rank is None
    s, h, b, r, c = batch.events
    assert isinstance(s, ForeignStored) and s.block_hashes == (-(2**63),) and s.cache_salt == "t1"
    assert isinstance(h, ForeignStored) and h.medium == "CPU_PINNED" and h.parent == -(2**63)
    assert isinstance(b, ForeignStored) and b.token_ids is None  # pairs, not token ids
    assert isinstance(r, ForeignRemoved) and r.block_hashes == (-5,)
    assert isinstance(c, ForeignCleared)
    assert decode_foreign_batch(msgpack.packb([3.0, [], 2])).data_parallel_rank == 2


def test_accepts_bytes_hashes_of_older_vllm() -> None:
    digest = bytes(range(32))
    payload = msgpack.packb(
        [1.0, [{"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": b"\x01" * 32,
                "token_ids": tokens(1), "block_size": BS}]]
    )  # fmt: skip
    (event,) = decode_foreign_batch(payload).events
    assert isinstance(event, ForeignStored)
    assert event.block_hashes == (digest,) and event.parent == b"\x01" * 32


def one(*events: Any) -> bytes:
    return bytes(msgpack.packb([1.0, list(events)]))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not msgpack"),
        (b"\x92\x01\x91\x81\x91\x01\x01", "not msgpack"),  # [1, [{[1]: 1}]]: a key no dict can hold
        (msgpack.packb({"engine": "e"}), "[ts, events]"),
        (msgpack.packb([1.0]), "[ts, events]"),
        (msgpack.packb(["now", []]), "ts must be a number"),
        (msgpack.packb([1.0, {}]), "events must be an array"),
        (msgpack.packb([1.0, [], "zero"]), "data_parallel_rank"),
        (one({"block_hashes": [1]}), "type must be a non-empty string"),
        (one([7, [1]]), "type must be a non-empty string"),
        (one([]), "non-empty array"),
        (one(["BlockStored", [1], None, [1]]), "at least 4 fields"),
        (one({"type": "BlockStored", "block_hashes": [1], "block_size": 4}), "token_ids"),
        (one(["BlockStored", [1.5], None, [1], 1]), "64-bit integer ids"),
        (one(["BlockStored", [b""], None, [1], 1]), "64-bit integer ids"),
        (one(["BlockStored", [1], "p", [1], 1]), "parent_block_hash"),
        (one(["BlockStored", [1], None, [-1], 1]), "token ids"),
        (one(["BlockStored", [1], None, [2**32], 1]), "token ids"),
        (one(["BlockStored", [1], None, [1], -1]), "block_size"),
        (one(["BlockStored", [1], None, [1], 1, None, 5]), "medium"),
        (one(["BlockStored", [1], None, [1], 1, None, "GPU", None, "x"]), "extra_keys"),
        (one(["BlockStored", [1], None, [1], 1, None, "GPU", {"cache_salt": 3}]), "cache_salt"),
        (one(["BlockRemoved"]), "block_hashes"),
        (one({"type": "BlockRemoved", "block_hashes": [1], "group_idx": "0"}), "group_idx"),
    ],
)
def test_rejects_malformed_payloads(payload: bytes, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode_foreign_batch(payload)


# -- translation -----------------------------------------------------------------------------------------


def stored(hashes: list[Any], parent: Any, toks: list[int] | None, **kw: Any) -> ForeignStored:
    return ForeignStored(tuple(hashes), parent, toks, kw.pop("block_size", BS), **kw)


def test_translation_equals_block_hashes_over_the_concatenated_tokens() -> None:
    """Chunked prefill spreads one prompt over several events linked by parents; generated tokens add
    blocks later. The chain is the one the gateway computes for the whole prompt."""
    prompt = tokens(7)
    ids = vp.vllm_block_hashes(prompt, BS).ids
    chain = ForeignChain(MODEL, block_size=BS)
    out = chain.apply([stored(ids[:3], None, prompt[: 3 * BS])])
    out += chain.apply([stored(ids[3:5], ids[2], prompt[3 * BS : 5 * BS])])
    out += chain.apply([stored(ids[5:], ids[4], prompt[5 * BS :])])
    assert stored_hashes(out) == kv(prompt)
    assert sorted(chain.held()) == sorted(kv(prompt))
    assert [e.parent for e in out if isinstance(e, BlockStored)] == [None, kv(prompt)[2], kv(prompt)[4]]
    assert chain.kvgate_hash(ids[6]) == kv(prompt)[6]


def test_salts_and_lora_names_give_separate_namespaces() -> None:
    prompt = tokens(2)
    chain = ForeignChain(MODEL, block_size=BS)
    plain = stored_hashes(chain.apply([stored([1, 2], None, prompt, extra_keys=(None, None))]))
    salted = stored_hashes(chain.apply([stored([3, 4], None, prompt, extra_keys=(("tenant-a",), None))]))
    other = stored_hashes(chain.apply([stored([5, 6], None, prompt, extra_keys=(("tenant-b",), None))]))
    lora = stored_hashes(
        chain.apply([stored([7, 8], None, prompt, lora_name="ad", lora_id=1, extra_keys=(("ad",), ("ad",)))])
    )
    lora_salted = stored_hashes(
        chain.apply(
            [
                stored(
                    [9, 10], None, prompt, lora_name="ad", lora_id=1, extra_keys=(("ad", "tenant-a"), ("ad",))
                )
            ]
        )
    )
    sglang = ForeignChain(MODEL, block_size=BS)  # SGLang says its salt in metadata
    sglang_salted = stored_hashes(sglang.apply([stored([-11, -12], None, prompt, cache_salt="tenant-a")]))
    assert plain == kv(prompt)
    assert salted == kv(prompt, salt="tenant-a") == sglang_salted
    assert other == kv(prompt, salt="tenant-b")
    assert lora == kv(prompt, name="ad")
    assert lora_salted == kv(prompt, name="ad", salt="tenant-a")
    assert len({plain[0], salted[0], other[0], lora[0], lora_salted[0]}) == 5
    # A child continues its parent's namespace: the salt is only ever on the first block.
    child = stored_hashes(chain.apply([stored([13], 4, tokens(1, start=2 * BS))]))
    assert child == kv(tokens(3), salt="tenant-a")[2:]


def test_duplicate_announcements_are_reference_counted() -> None:
    prompt = tokens(2)
    ids = [11, 12]
    chain = ForeignChain(MODEL, block_size=BS)
    first = chain.apply([stored(ids, None, prompt)])
    again = chain.apply([stored(ids, None, prompt)])  # a second physical copy of the same blocks
    assert stored_hashes(first) == kv(prompt) and again == []
    assert removed_hashes(chain.apply([ForeignRemoved((12,))])) == []  # one copy of block 2 is left
    assert chain.holds(kv(prompt)[1])
    assert removed_hashes(chain.apply([ForeignRemoved((12,))])) == [kv(prompt)[1]]
    assert chain.apply([ForeignRemoved((12,)), ForeignRemoved((999,))]) == []  # unknown: ignored
    assert chain.held() == [kv(prompt)[0]]


def test_unknown_parent_is_flagged_and_never_indexed() -> None:
    chain = ForeignChain(MODEL, block_size=BS)
    out = chain.apply([stored([21, 22], 20, tokens(2, start=BS))])
    assert out == [] and chain.unknown_parent_blocks == 2
    out = chain.apply([stored([23], 22, tokens(1, start=3 * BS))])  # its child: unknown as well
    assert out == [] and chain.unknown_parent_blocks == 3 and chain.held() == []


def test_multimodal_and_embedding_blocks_are_known_but_never_indexed() -> None:
    prompt = tokens(4)
    chain = ForeignChain(MODEL, block_size=BS)
    # Block 2 holds an image: it and everything after it depend on the image, not only on tokens.
    out = chain.apply([stored([1, 2, 3], None, prompt[: 3 * BS], extra_keys=(None, (["img", 3],), None))])
    assert stored_hashes(out) == kv(prompt)[:1]
    out = chain.apply([stored([4], 3, prompt[3 * BS :])])
    assert out == [] and chain.unknown_parent_blocks == 0 and chain.unindexable_blocks == 3
    assert chain.known(4)
    embeds = chain.apply([stored([5], None, prompt[:BS], extra_keys=((b"\x00" * 32,),))])
    assert embeds == []
    assert chain.apply([ForeignRemoved((2, 3, 4))]) == [] and not chain.known(4)


def test_other_media_groups_and_block_sizes_are_not_indexed() -> None:
    prompt = tokens(2)
    chain = ForeignChain(MODEL, block_size=BS)
    assert chain.apply([stored([1, 2], None, prompt, medium="CPU")]) == []
    assert chain.apply([stored([1, 2], None, prompt, medium="CPU_PINNED")]) == []
    assert chain.apply([stored([1, 2], None, prompt, group_idx=1)]) == []
    assert chain.ignored_blocks == 6 and len(chain) == 0
    half = chain.apply([stored([3], None, prompt[: BS // 2], block_size=BS // 2)])  # a partial entry
    assert half == [] and chain.unindexable_blocks == 1
    assert chain.apply([stored([4], None, None)]) == []  # non-token pages (SGLang bigrams)
    assert stored_hashes(chain.apply([stored([1, 2], None, prompt, medium="gpu")])) == kv(prompt)
    # A GPU removal undoes a GPU store; a CPU removal of the same ids does not.
    assert chain.apply([ForeignRemoved((1, 2), medium="CPU")]) == []
    assert removed_hashes(chain.apply([ForeignRemoved((2, 1), medium="GPU")])) == kv(prompt)[::-1]


def test_a_lora_known_only_by_id_is_not_indexed() -> None:
    chain = ForeignChain(MODEL, block_size=BS)
    assert chain.apply([stored([1], None, tokens(1), lora_id=7)]) == []
    assert chain.unindexable_blocks == 1


def test_clear_and_data_parallel_ranks() -> None:
    prompt = tokens(3)
    chain = ForeignChain(MODEL, block_size=BS)
    # Rank 0 and rank 1 hash with different seeds (PYTHONHASHSEED): other ids, same kvgate hashes.
    assert stored_hashes(chain.apply([stored([1, 2, 3], None, prompt)], rank=0)) == kv(prompt)
    assert chain.apply([stored([91, 92], None, prompt[: 2 * BS])], rank=1) == []
    # Rank 0 evicts everything: blocks 1-2 stay, rank 1 holds them.
    out = chain.apply([ForeignRemoved((3,)), ForeignRemoved((2,)), ForeignRemoved((1,))], rank=0)
    assert removed_hashes(out) == [kv(prompt)[2]]
    assert sorted(chain.held()) == sorted(kv(prompt)[:2])
    # A rank's clear removes only what no other rank holds; the last one clears all.
    chain.apply([stored([1, 2, 3], None, prompt)], rank=0)
    assert chain.apply([ForeignCleared()], rank=0) == [BlockRemoved((kv(prompt)[2],))]
    assert chain.apply([ForeignCleared()], rank=1) == [AllCleared()]
    assert chain.held() == [] and len(chain) == 0
    # reset_rank forgets one rank the same way.
    chain.apply([stored([1], None, prompt[:BS])], rank=0)
    chain.apply([stored([91], None, prompt[:BS])], rank=1)
    chain.reset_rank(1)
    assert chain.held() == kv(prompt)[:1] and not chain.known(91, rank=1)


def test_block_size_unknown_takes_the_events_own() -> None:
    chain = ForeignChain(MODEL)
    out = chain.apply([stored([1], None, list(range(32)), block_size=32)])
    assert stored_hashes(out) == block_hashes(list(range(32)), 32, namespace_seed(MODEL))
    # Tokens that do not fill the announced blocks cannot be hashed as those blocks.
    assert chain.apply([stored([2, 3], None, list(range(40)), block_size=32)]) == []


# -- frames recorded from a real vLLM 0.32.0 ------------------------------------------------------------

RECORDING = Path(__file__).parent.parent / "data" / "vllm-0.32.0-kv-events"
REC_BS = 32
REC_MODEL = "tiny"


def recording() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if not (RECORDING / "frames.jsonl").exists():
        pytest.skip("no recording of vLLM 0.32.0 KV events here")
    lines = (RECORDING / "frames.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], json.loads((RECORDING / "requests.json").read_text())


def test_recorded_vllm_0_32_batches_translate_to_the_gateways_hashes() -> None:
    """Every batch a real vLLM 0.32.0 published (block size 32: a chunked 500-token prompt, a block filled
    by generated tokens, a salted repeat, a chat, prompts that force evictions, a prefix-cache reset), in
    seq order: after each step the translator holds, for every prompt seen, exactly the leading blocks
    whose engine ids the engine still holds, under the hashes the gateway computes from the request."""
    frames, requests = recording()
    live = sorted((r for r in frames if r["socket"] == "sub"), key=lambda r: r["seq"])
    assert [r["seq"] for r in live] == list(range(len(live)))
    chain = ForeignChain(REC_MODEL, block_size=REC_BS)
    present: dict[int, int] = {}  # engine id -> copies, straight from the raw events
    prompts: list[tuple[list[int], list[int]]] = []  # (kvgate hashes of the request, engine ids in order)
    steps = {s["step"]: s for s in requests["steps"]}
    long_ids = requests["long_prompt_token_ids"]
    for name, step in steps.items():
        records = [r for r in live if r["step"] == name]
        ids: list[int] = []
        for record in records:
            payload = bytes.fromhex(record["frames"][2])
            batch = decode_foreign_batch(payload)
            assert batch.data_parallel_rank == 0
            chain.apply(batch.events)
            for event in msgpack.unpackb(payload)[1]:
                if event["type"] == "BlockStored":
                    ids += event["block_hashes"]
                    for h in event["block_hashes"]:
                        present[h] = present.get(h, 0) + 1
                elif event["type"] == "BlockRemoved":
                    for h in event["block_hashes"]:
                        present[h] -= 1
                else:
                    present.clear()
        body = step["requests"][0]["body"] if step.get("requests") else None
        if name.startswith(("A-", "D-", "F-", "H-")):
            assert body is not None
            seed = namespace_seed(REC_MODEL, body.get("cache_salt") or "")
            prompts.append((block_hashes(body["prompt"], REC_BS, seed), ids))
        elif name.startswith("C-"):  # block 15: the prompt's last 20 tokens and 12 generated ones
            generated = msgpack.unpackb(bytes.fromhex(records[0]["frames"][2]))[1][0]["token_ids"]
            assert generated[:20] == long_ids[480:]
            tokens = long_ids[:480] + generated
            prompts.append((block_hashes(tokens, REC_BS, namespace_seed(REC_MODEL)), prompts[0][1] + ids))
        elif name.startswith("E-"):
            chat = block_hashes(step["chat_prompt_token_ids"], REC_BS, namespace_seed(REC_MODEL))
            prompts.append((chat, ids))
        held = set(chain.held())
        for khashes, engine_ids in prompts:
            n = 0
            while n < min(len(khashes), len(engine_ids)) and present.get(engine_ids[n], 0) > 0:
                n += 1
            assert [h in held for h in khashes[:n]] == [True] * n, name
            assert n == len(khashes) or khashes[n] not in held, name
        assert len(held) == sum(1 for c in present.values() if c > 0), name
    assert chain.unknown_parent_blocks == 0 and chain.unindexable_blocks == 0 and chain.ignored_blocks == 0
    assert len(prompts[-1][0]) == 15 and set(prompts[-1][0]) == set(chain.held())  # after the reset: H only


def test_a_salt_per_request_leaves_no_memory_behind_once_its_blocks_are_gone() -> None:
    # vLLM's cache_salt is per request, and a client may send a new one every time (one per end user, or
    # per request): the chain must not keep something per salt it ever saw once nothing is held under it.
    chain = ForeignChain(MODEL, block_size=BS)
    toks = tokens(1)

    def one_request(i: int) -> list[KvEvent]:
        salt = f"user-{i:08d}-of-a-large-consumer-app"
        out = chain.apply([stored([i + 1], None, toks, extra_keys=((salt,),))])
        assert stored_hashes(out) == kv(toks, salt=salt)
        return out + chain.apply([ForeignRemoved((i + 1,))])

    grown = bytes_kept(one_request)
    assert len(chain) == 0 and chain.held() == []
    assert grown < 500_000, f"{grown} bytes kept after 20,000 salts, each of whose blocks is gone"
