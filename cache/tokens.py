"""Tokenizers: the text -> token ids step whose output gets block-hashed (chats are rendered as text first,
by cache.chat_template).

Gateway and engine must turn the same request into the same token ids or their block hashes disagree, so
this lives beside the hash function. Without a model directory, a byte-level tokenizer (ids 0-255 are
bytes) stands in; with one, its ``tokenizer.json`` is loaded through the ``tokenizers`` package.
"""

from __future__ import annotations

import array
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cache.chat_template import ChatTemplate, load_chat_template
from cache.chat_template import TokenizerError as TokenizerError  # (callers import it from here)
from cache.token_chunks import CHUNK_CHARS, chunker_for


class Tokenizer(Protocol):
    name: str
    eos_token_id: int
    vocab_size: int
    chat_template: ChatTemplate | None  # the model's own (tokenizer_config.json); None: ChatML

    def encode(self, text: str, namespace: str = "") -> np.ndarray:
        """Token ids (uint32) of ``text``, with no special tokens added. ``namespace`` (the gateway passes
        the tenant's cache salt) scopes whatever the tokenizer caches: text cached for one namespace is not
        found for another, so how long an encode takes says nothing about what other tenants sent."""
        ...

    def encode_public(self, text: str) -> np.ndarray:
        """``encode``, for text the operator declared public (``gateway.shared_prefixes``): what it caches
        is found from every namespace, and stays for the tokenizer's life (see ``HFTokenizer._public``)."""
        ...

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text, none of them cached: texts that do not recur (an embeddings request's
        documents), encoded together (Hugging Face's batch call uses every core, without the GIL)."""
        ...

    def with_special_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        """``token_ids`` with the special tokens the tokenizer's post-processor adds around a text (a BOS,
        say): what Hugging Face's ``add_special_tokens=True`` gives, as vLLM and SGLang encode a completion's
        text prompt (vLLM's ``add_special_tokens`` defaults to true there, false for chats)."""
        ...

    def decode(self, token_ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus end-of-text: the built-in tokenizer when no model is configured."""

    name = "kvgate-bytes"
    eos_token_id = 256
    vocab_size = 257
    chat_template: ChatTemplate | None = None

    def encode(self, text: str, namespace: str = "") -> np.ndarray:
        # Nothing is cached, so there is nothing to keep apart: the namespace does not matter.
        return np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8).astype(np.uint32)

    def encode_public(self, text: str) -> np.ndarray:
        return self.encode(text)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def with_special_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        return token_ids  # (no post-processor)

    def decode(self, token_ids: Iterable[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (fast tokenizer) loaded with the ``tokenizers`` package."""

    def __init__(
        self, path: Path, eos_token_id: int | None = None, chat_template: ChatTemplate | None = None
    ) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        # Token ids without their character offsets (nothing here reads them): about 0.6x the time of
        # ``encode_batch`` on long texts (bench_tokenizer), less on short ones too, and like it without the
        # GIL (tokenizers 0.20+).
        self._encode_batch = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        self.chat_template = chat_template
        self.name = path.parent.name
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = eos_token_id if eos_token_id is not None else self._guess_eos()
        config = _parsed(self._tok)
        self._segments = _segment_splitter(config)
        # Long pieces are cut into chunks where that cannot change a token (cache.token_chunks): a text
        # that grows at its end then re-encodes only its tail.
        self._chunker = (
            chunker_for(config) if self._segments is not None or not config.get("added_tokens") else None
        )
        # Pieces and chunks by (namespace, text), least recently used first, all namespaces within one
        # budget. The namespace is part of the key because a hit is faster than a miss: a shared cache would
        # tell a tenant whether another tenant had sent the same text (README, "Cache isolation").
        self._cache: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._cached_chars = 0
        # Pieces and chunks of operator-declared public text (encode_public), found from every namespace.
        # Written only by encode_public (at start-up) and never evicted, so whether a lookup hits here
        # depends on the text looked up and the configuration, never on what any tenant sent. (Kept in the
        # LRU instead, an evicted entry would come back when the next tenant sent it: a hit for a later one
        # would tell that someone had.) Its size is the operator's prefixes', outside the budget.
        self._public: dict[str, np.ndarray] = {}
        self._lock = (
            threading.Lock()
        )  # encode may run on several threads at once (the gateway's long prompts)
        self._special_before, self._special_after = self._added_around()

    def _added_around(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids the post-processor puts before and after a text (Llama's BOS; BERT's [CLS] and [SEP]),
        found once by encoding a sample with and without them: added_special_tokens is those around the
        plain ids, whatever the text (TemplateProcessing, BertProcessing and RobertaProcessing alike)."""
        plain = self._encode_batch(["kv"], add_special_tokens=False)[0].ids
        full = self._encode_batch(["kv"], add_special_tokens=True)[0].ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return uint32_array(full[:start]), uint32_array(full[start + len(plain) :])
        return uint32_array([]), uint32_array([])  # (a post-processor that rewrites the text's own ids)

    def with_special_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        before, after = self._special_before, self._special_after
        if not len(before) and not len(after):
            return token_ids
        return np.concatenate((before, token_ids, after)).astype(np.uint32, copy=False)

    def _guess_eos(self) -> int:
        for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<eos>"):
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return int(token_id)
        return self.vocab_size - 1

    def encode(self, text: str, namespace: str = "") -> np.ndarray:
        return self._encode(text, namespace)

    def encode_public(self, text: str) -> np.ndarray:
        return self._encode(text, None)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        return [uint32_array(e.ids) for e in self._encode_batch(texts, add_special_tokens=False)]

    def _encode(self, text: str, namespace: str | None) -> np.ndarray:
        """``text``'s ids, its pieces cached in ``namespace``; None: in the public table."""
        if len(text) < _MIN_CACHED_CHARS:
            return self._encode_uncached(text)
        if self._segments is None:  # no special tokens to split at (then the chunker may still cut)
            if self._chunker is None:
                return self._encode_uncached(text)
            return self._encode_piece(text, namespace)
        # The tokenizer splits its input at special tokens before anything else, so the pieces between them
        # encode independently: a system prompt or an earlier turn that every request of a conversation
        # resends is encoded once and then taken from the cache.
        pattern, special_ids = self._segments
        parts: list[np.ndarray] = []
        for i, piece in enumerate(pattern.split(text)):
            if i % 2:
                parts.append(special_ids[piece])
            elif piece:
                parts.append(self._encode_piece(piece, namespace))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)

    def _encode_piece(self, piece: str, namespace: str | None) -> np.ndarray:
        if self._chunker is not None and len(piece) >= 2 * CHUNK_CHARS:
            return self._encode_chunks(self._chunker(piece), namespace)
        return self._encode_cached(piece, namespace)

    def _encode_chunks(self, chunks: list[str], namespace: str | None) -> np.ndarray:
        """A long text's chunks, from the cache where they are; the others in one ``encode_batch`` call,
        which encodes them on all cores and without the GIL (0.51-0.61x the time of one call each for new
        48k-character texts on two cores: tests/bench/bench_tokenizer.py)."""
        with self._lock:
            found = [self._lookup(chunk, namespace) for chunk in chunks]
        missing = list(dict.fromkeys(c for c, ids in zip(chunks, found, strict=True) if ids is None))
        new: dict[str, np.ndarray] = {}
        if missing:
            encoded = self._encode_batch(missing, add_special_tokens=False)
            new = {chunk: uint32_array(e.ids) for chunk, e in zip(missing, encoded, strict=True)}
            with self._lock:
                for chunk, ids in new.items():
                    self._store(chunk, namespace, ids)
        return np.concatenate([new[c] if ids is None else ids for c, ids in zip(chunks, found, strict=True)])

    def _encode_cached(self, piece: str, namespace: str | None) -> np.ndarray:
        with self._lock:
            hit = self._lookup(piece, namespace)
        if hit is not None:
            return hit
        ids = self._encode_uncached(piece)
        with self._lock:
            self._store(piece, namespace, ids)
        return ids

    def _lookup(self, piece: str, namespace: str | None) -> np.ndarray | None:
        """``piece``'s cached ids: public ones for any namespace, else ``namespace``'s own (hold the lock)."""
        hit = self._public.get(piece)
        if hit is not None or namespace is None:
            return hit
        key = (namespace, piece)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def _store(self, piece: str, namespace: str | None, ids: np.ndarray) -> None:
        """Cache ``piece``'s ids in ``namespace``; None: in the public table (hold the lock)."""
        if namespace is None:
            self._public[piece] = ids
        else:
            self._remember((namespace, piece), ids)

    def _remember(self, key: tuple[str, str], ids: np.ndarray) -> None:
        """Cache ``key``'s ids, evicting the least recently used beyond the budget (hold the lock)."""
        if key not in self._cache:
            self._cache[key] = ids
            self._cached_chars += _entry_chars(key)
        while self._cached_chars > _CACHE_CHARS:
            old, _ = self._cache.popitem(last=False)
            self._cached_chars -= _entry_chars(old)

    def _encode_uncached(self, text: str) -> np.ndarray:
        # ``encode`` holds the GIL for the whole encoding; the batch call releases it, so a long prompt
        # tokenized on a worker thread does not stop the event loop (and uses another core).
        return uint32_array(self._encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, token_ids: Iterable[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))


# A whole text this short is one tokenizer call; split at special tokens, even its short pieces are cached:
# role headers ("assistant\n") recur in every chat, and a lookup costs a tenth of a call.
_MIN_CACHED_CHARS = 256
_CACHE_CHARS = 16 << 20
_ENTRY_CHARS = 128  # an entry's own memory, counted in characters, so short pieces cannot swell the cache


def _entry_chars(key: tuple[str, str]) -> int:
    """What a cache entry is charged: its text, its namespace (a client's cache_salt makes each request's
    namespace a string of its own) and its overhead."""
    namespace, piece = key
    return len(piece) + len(namespace) + _ENTRY_CHARS


_UINT32_CODE = "I" if array.array("I").itemsize == 4 else "L"  # C unsigned int: 4 bytes on every ABI we know


def uint32_array(ids: list[int]) -> np.ndarray:
    """Token ids as uint32, three to five times faster than ``np.asarray(ids, dtype=np.uint32)``. Raises
    OverflowError for an id outside [0, 2**32) and TypeError for anything but an int (a bool is an int)."""
    return np.frombuffer(array.array(_UINT32_CODE, ids), dtype=np.uint32)


def _parsed(tok: Any) -> dict[str, Any]:
    """The tokenizer's own description (tokenizer.json), or {} when it cannot give one."""
    try:
        config = json.loads(tok.to_str())
    except (ValueError, TypeError):
        return {}
    return config if isinstance(config, dict) else {}


def _segment_splitter(config: dict[str, Any]) -> tuple[re.Pattern[str], dict[str, np.ndarray]] | None:
    """A regex that splits text at the tokenizer's special tokens (kept as separators) and their ids, when
    splitting first is exactly what the tokenizer does: no special token strips or absorbs its neighbours."""
    added = config.get("added_tokens") or []
    special = [a for a in added if a.get("special")]
    if not special or any(
        a.get("lstrip") or a.get("rstrip") or a.get("single_word") or a.get("normalized") for a in special
    ):
        return None
    contents = sorted((a["content"] for a in special), key=len, reverse=True)
    ids = {a["content"]: np.array([a["id"]], dtype=np.uint32) for a in special}
    return re.compile("(" + "|".join(re.escape(c) for c in contents) + ")"), ids


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """``tokenizer.json`` of a Hugging Face model directory; the byte tokenizer when ``model_dir`` is None."""
    if model_dir is None:
        return ByteTokenizer()
    directory = Path(model_dir)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: no tokenizer.json in the model directory")
    eos: int | None = None
    config_path = directory / "config.json"
    if config_path.is_file():
        try:
            raw_eos = json.loads(config_path.read_text()).get("eos_token_id")
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{config_path}: {exc}") from None
        if isinstance(raw_eos, list) and raw_eos:
            raw_eos = raw_eos[0]
        eos = raw_eos if isinstance(raw_eos, int) else None
    template = load_chat_template(directory)
    try:
        return HFTokenizer(path, eos, template)
    except Exception as exc:  # the tokenizers package raises its own Exception subclass
        raise TokenizerError(f"{path}: {exc}") from None


def pack_token_ids(ids: np.ndarray) -> str:
    """Token ids as 8 hex digits each, big-endian (``prompt_token_ids_hex``, gateway to engine): "0000000a"
    is id 10. Both ways run in C at gigabytes per second; base64 decodes four times slower in CPython, and a
    JSON array of numbers costs an engine about 25 ns per id to read."""
    return ids.astype(">u4", copy=False).tobytes().hex()
