"""The gateway's tokenizer on long new texts: chunks encoded in one batch against one by one, and texts
that cannot be cut encoded without character offsets against with them; then chat texts whose pieces between
special tokens come from the cache, against one call of the tokenizer on the whole text.

    python tests/bench/bench_tokenizer.py [--chars 48000] [--texts 6]

A GPT-2-style byte-level BPE (regex pre-tokenizer, trained here on random words) encodes texts it has never
seen, so every chunk misses the chunk cache. ``HFTokenizer.encode`` cuts them at word gaps and encodes the
missing chunks in one batch call (all cores, no GIL); the baseline, measured in the same run, encodes the
same chunks one call each. Every measure must give the tokenizer's own ids (one plain ``encode`` call).

Texts with no word gap (base64, minified code, long identifiers) are not cut: each is one call, which
``HFTokenizer`` makes with ``encode_batch_fast`` (no character offsets; tokenizers 0.20+), against the
``encode_batch`` call it made before.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cache.chat_template import render_chat
from cache.token_chunks import split_chunks
from cache.tokens import HFTokenizer

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "cache", "block", "token",
         "prefix", "model", "gateway", "engine", "12345", "3.14", "(see)", "don't", "naïve"]  # fmt: skip


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(map(len, words)) + len(words) < chars:
        words.append(rng.choice(WORDS) + rng.choice(["", "", "s", "ed", "ing", str(rng.randrange(100))]))
    return " ".join(words)


def gapless(rng: random.Random, chars: int) -> str:
    """Text the chunker cannot cut (no letter-space-letter gap): base64-like runs."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
    return "".join(rng.choice(alphabet) for _ in range(chars))


def compare(
    ours: Callable[[str], Sequence[int]],
    baseline: Callable[[str], Sequence[int]],
    texts: list[str],
    reference: Callable[[str], Sequence[int]],
) -> tuple[float, float]:
    """Seconds to encode ``texts`` with ``ours``, then with ``baseline``; both must give ``reference``'s
    ids (the tokenizer's own, untimed)."""
    seconds, results = [], []
    for encode in (ours, baseline):
        start = time.perf_counter()
        results.append([encode(t) for t in texts])
        seconds.append(time.perf_counter() - start)
    expected = [list(reference(t)) for t in texts]
    assert [list(map(int, ids)) for ids in results[0]] == [list(ids) for ids in results[1]] == expected
    return seconds[0], seconds[1]


def by_chunks(raw: Tokenizer, text: str) -> list[int]:
    """The baseline before chunks were batched: each chunk its own tokenizer call."""
    return [i for c in split_chunks(text) for i in raw.encode(c, add_special_tokens=False).ids]


def with_offsets(raw: Tokenizer, text: str) -> list[int]:
    """The baseline before ``encode_batch_fast``: the batch call that also computes character offsets."""
    return list(raw.encode_batch([text], add_special_tokens=False)[0].ids)


def plain(raw: Tokenizer, text: str) -> list[int]:
    """The tokenizer's own ids: one ``encode`` call."""
    return list(raw.encode(text, add_special_tokens=False).ids)


def whole(raw: Tokenizer, text: str) -> list[int]:
    """The tokenizer alone on the whole text (as one call, no cache)."""
    return list(raw.encode_batch_fast([text], add_special_tokens=False)[0].ids)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chars", type=int, default=48_000)
    parser.add_argument("--texts", type=int, default=6)
    args = parser.parse_args()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Tokenizer(models.BPE())
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        corpus = [text(rng, 400) for _ in range(300)]
        raw.train_from_iterator(
            corpus,
            trainers.BpeTrainer(
                vocab_size=2000, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False
            ),
        )
        raw.save(str(Path(tmp) / "tokenizer.json"))
        path = Path(tmp) / "tokenizer.json"
        texts = [text(rng, args.chars) for _ in range(3 * args.texts)]
        own = partial(plain, raw)
        batched_s, one_by_one_s, fast_s, offsets_s, chat_s, whole_s = [], [], [], [], [], []
        system = text(rng, 1500)
        for i in range(3):  # fresh texts and a fresh tokenizer (empty cache) every round, alternating
            tok = HFTokenizer(path)
            chunk = texts[i * args.texts : (i + 1) * args.texts]
            ours, base = compare(tok.encode, partial(by_chunks, raw), chunk, own)
            batched_s.append(ours)
            one_by_one_s.append(base)
            uncut = [gapless(rng, args.chars) for _ in range(args.texts)]
            ours, base = compare(tok.encode, partial(with_offsets, raw), uncut, own)
            fast_s.append(ours)
            offsets_s.append(base)
            chats = [  # one system prompt, a new user turn each time: what a chat gateway sees
                render_chat(
                    [{"role": "system", "content": system}, {"role": "user", "content": text(rng, 60)}]
                )
                for _ in range(200)
            ]
            tok.encode(chats[0])
            ours, base = compare(tok.encode, partial(whole, raw), chats, own)
            chat_s.append(ours)
            whole_s.append(base)
    b, o = min(batched_s) / args.texts, min(one_by_one_s) / args.texts
    f, w = min(fast_s) / args.texts, min(offsets_s) / args.texts
    print(f"{args.chars}-character new texts on {len(os.sched_getaffinity(0))} CPUs, best of 3 rounds:")
    print(f"  chunks in one batch {b * 1e3:.2f} ms, one by one {o * 1e3:.2f} ms -> ratio {b / o:.3f}")
    print(f"  uncut texts without offsets {f * 1e3:.2f} ms, with offsets {w * 1e3:.2f} ms", end=" ")
    print(f"-> ratio {f / w:.3f}")
    c, a = min(chat_s) / 200, min(whole_s) / 200
    print(
        f"chat texts (a 1.5k-character system prompt, a new 60-character user turn each): {c * 1e6:.1f} us, "
        f"the tokenizer alone on the whole text {a * 1e6:.1f} us -> ratio {c / a:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
