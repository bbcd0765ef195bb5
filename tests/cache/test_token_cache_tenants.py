"""The tokenizer's piece and chunk cache is split by namespace (the tenant's cache salt): a tenant never hits
what another tenant's text put there, so its encode time says nothing about what others sent (README,
"Cache isolation"). Only text the operator declared public is found from every namespace.

No timings here: the mechanism is observed by counting the calls that reach the tokenizer's batch encode,
which ``HFTokenizer`` makes for every piece or group of chunks its cache does not have."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache.chat_template import render_chat
from cache.token_chunks import CHUNK_CHARS
from cache.tokens import HFTokenizer, load_tokenizer
from gateway.config import GatewaySettings
from gateway.prepare import RequestPreparer
from gateway.tenancy.tenants import tenant_from_config
from region_map.config import parse_topology
from region_map.fleet import Fleet
from tests.memory import bytes_kept
from tests.models import make_tokenizer_dir

A, B = "tenant:acme", "tenant:globex"
# Letters around spaces (word gaps) so that the chunker can cut it; distinct words so chunks differ.
LONG_BODY = " ".join(f"brown{i}fox the quick" for i in range(500))
SYSTEM = "You are the support assistant of a large company; answer briefly and politely. " * 8
TEXTS = {
    # Split at special tokens into short pieces, each cached on its own (the segment path).
    "segments": render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]),
    # One long piece cut into chunks, the missing ones encoded in one batch (the chunk path).
    "chunks": LONG_BODY,
    # Both: short pieces and a long user turn cut into chunks.
    "chat": render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG_BODY}]),
}


@dataclass
class BatchCalls:
    """Instrumentation: what reaches the tokenizer's batch encode (the cache's misses), call by call."""

    tok: HFTokenizer
    calls: list[list[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        inner = self.tok._encode_batch

        def counted(texts: list[str], **kwargs: Any) -> Any:
            self.calls.append(list(texts))
            return inner(texts, **kwargs)

        self.tok._encode_batch = counted

    def encode(self, text: str, namespace: str) -> tuple[list[int], list[list[str]]]:
        """``text``'s ids in ``namespace`` and the batch calls that took."""
        before = len(self.calls)
        ids = self.tok.encode(text, namespace).tolist()
        return ids, self.calls[before:]


@pytest.fixture
def tok(tmp_path: Path) -> HFTokenizer:
    loaded = load_tokenizer(make_tokenizer_dir(tmp_path / "tok"))
    assert isinstance(loaded, HFTokenizer) and loaded._segments is not None and loaded._chunker is not None
    return loaded


@pytest.mark.parametrize("kind", list(TEXTS))
def test_a_text_cached_for_one_tenant_is_a_miss_for_another(tok: HFTokenizer, kind: str) -> None:
    text = TEXTS[kind]
    spy = BatchCalls(tok)
    plain = tok._tok.encode(text, add_special_tokens=False).ids

    a_ids, a_calls = spy.encode(text, A)
    assert a_ids == plain and a_calls  # new text: encoded
    if kind != "segments":
        assert any(len(call) > 1 for call in a_calls)  # several new chunks in one batch
        assert all(len(piece) <= 2 * CHUNK_CHARS for call in a_calls for piece in call)
    b_ids, b_calls = spy.encode(text, B)
    assert b_ids == plain
    assert b_calls == a_calls  # everything encoded again: nothing of A's was found
    assert spy.encode(text, A) == (plain, [])  # A's second request: all from the cache
    assert spy.encode(text, B) == (plain, [])  # and now B's own
    assert spy.encode(text, "") == (plain, a_calls)  # the default namespace is one more of its own
    assert {namespace for namespace, _ in tok._cache} == {A, B, ""}


def test_a_growing_conversation_reuses_only_its_own_tenants_pieces(tok: HFTokenizer) -> None:
    spy = BatchCalls(tok)
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG_BODY}]
    spy.encode(render_chat(turns), A)
    more = [*turns, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "More, please."}]
    longer = render_chat(more)
    _, a_calls = spy.encode(longer, A)
    assert a_calls == [["assistant\nSure."], ["user\nMore, please."]]  # only the new turns
    _, b_calls = spy.encode(longer, B)
    encoded = {piece for call in b_calls for piece in call}
    assert "user\nMore, please." in encoded and len(encoded) > 3  # B: everything, not only the new turns


@pytest.mark.parametrize("system", [SYSTEM, LONG_BODY], ids=["piece", "chunks"])
def test_declared_public_text_is_found_from_every_namespace(tok: HFTokenizer, system: str) -> None:
    spy = BatchCalls(tok)
    rendered = render_chat([{"role": "system", "content": system}], add_generation_prompt=False)
    tok.encode_public(rendered)  # at start-up (RequestPreparer)
    public = dict(tok._public)
    assert public and not tok._cache
    text = render_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": "acme's question " * 20}]
    )
    plain = tok._tok.encode(text, add_special_tokens=False).ids
    for namespace in (A, B):
        ids, calls = spy.encode(text, namespace)
        encoded = {piece for call in calls for piece in call}
        assert ids == plain
        assert not encoded & public.keys()  # the public part: found, for each tenant
        assert any("acme's question" in piece for piece in encoded)  # the tenant's own part: a miss for both
    # Requests never write the public table: whether a lookup hits there depends on configuration alone.
    assert tok._public == public
    assert all(piece not in public for _, piece in tok._cache)


def test_all_namespaces_share_one_budget(tok: HFTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    import cache.tokens as tokens

    monkeypatch.setattr(tokens, "_CACHE_CHARS", 50 * (tokens._ENTRY_CHARS + 400))
    for i in range(200):
        text = render_chat([{"role": "user", "content": f"turn {i:05d} " + "and so on " * 30}])
        assert tok.encode(text, f"tenant:t{i % 7}").tolist() == tok._tok.encode(text).ids
    assert {namespace for namespace, _ in tok._cache} == {f"tenant:t{i}" for i in range(7)}
    assert tok._cached_chars <= tokens._CACHE_CHARS
    assert tok._cached_chars == sum(tokens._entry_chars(key) for key in tok._cache)


# -- through the gateway's request preparation ---------------------------------------------------------


@dataclass
class FakeClientRequest:
    """The little of an HTTP request RequestPreparer reads (gateway.prepare.ClientRequest)."""

    headers: dict[str, str] = field(default_factory=dict)
    remote: str | None = "127.0.0.1"
    content_length: int | None = None

    async def read(self) -> bytes:
        raise AssertionError("not read: the tests hand RequestPreparer the parsed body")


async def test_request_preparation_encodes_in_the_tenants_namespace(tok: HFTokenizer) -> None:
    engine = {"name": "e", "url": "http://127.0.0.1:9", "model": "m"}  # never called: preparing only
    fleet = Fleet(parse_topology({"region": "r", "regions": [{"name": "r", "engines": [engine]}]}))
    prepare = RequestPreparer(GatewaySettings(shared_prefixes=[SYSTEM]), fleet, tok)
    spy = BatchCalls(tok)
    acme, globex = tenant_from_config("acme", None), tenant_from_config("globex", None)
    question = "what is the status of my order? " * 10
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }

    async def encoded(tenant: Any, **extra: Any) -> tuple[np.ndarray, set[str]]:
        before = len(spy.calls)
        prepared = await prepare.chat(FakeClientRequest(), {**body, **extra}, tenant)
        return prepared.token_ids, {piece for call in spy.calls[before:] for piece in call}

    a_ids, a_pieces = await encoded(acme)
    assert any(question in piece for piece in a_pieces)
    assert not a_pieces & tok._public.keys()  # the declared system prompt came from the public table
    b_ids, b_pieces = await encoded(globex)
    assert np.array_equal(a_ids, b_ids) and b_pieces == a_pieces  # acme's question: not found for globex
    again, pieces = await encoded(acme)
    assert np.array_equal(again, a_ids) and not pieces  # acme's own, found
    _, client_split = await encoded(acme, cache_salt="alice")
    assert client_split == a_pieces  # a client's cache_salt splits its tenant's namespace as it splits KV
    assert {namespace for namespace, _ in tok._cache} == {
        "tenant:acme",
        "tenant:globex",
        "11:tenant:acme:alice",
    }


def test_a_cache_salt_per_request_leaves_no_memory_behind(tok: HFTokenizer) -> None:
    # A client may send a new cache_salt with every request (one per end user, or per request): the
    # preparer hashes each prompt in its salt's namespace, and must not keep something per salt for ever.
    engine = {"name": "e", "url": "http://127.0.0.1:9", "model": "m"}  # never called: hashing only
    fleet = Fleet(parse_topology({"region": "r", "regions": [{"name": "r", "engines": [engine]}]}))
    prepare = RequestPreparer(GatewaySettings(), fleet, tok)
    ids = np.arange(64, dtype=np.uint32)

    def one_request(i: int) -> None:
        prepare.block_hashes(ids, "m", f"11:tenant:acme:user-{i:08d}-of-a-large-consumer-app")

    grown = bytes_kept(one_request)
    assert grown < 500_000, f"{grown} bytes kept after 20,000 salts"
