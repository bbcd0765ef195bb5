"""Sampling parameters do what they say; text deltas survive multi-byte characters and stop strings."""

from __future__ import annotations

from collections import Counter

import torch

from cache.tokens import ByteTokenizer
from engine.detokenizer import IncrementalDetokenizer
from engine.sampler import make_generator, sample
from engine.sequence import SamplingParams

LOGITS = torch.tensor([[0.0, 3.0, 2.9, 2.8, -5.0]])


def draws(params: SamplingParams, n: int = 400, seed: int = 0) -> Counter[int]:
    g = make_generator(seed)
    return Counter(sample(LOGITS, [params], [g])[0] for _ in range(n))


def test_greedy_and_top_k_one_take_the_argmax() -> None:
    assert draws(SamplingParams(temperature=0.0)) == Counter({1: 400})
    assert draws(SamplingParams(temperature=1.0, top_k=1)) == Counter({1: 400})


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    assert set(draws(SamplingParams(temperature=1.0, top_k=2))) == {1, 2}
    # Tokens 1, 2, 3 hold ~0.97 of the mass: top_p 0.5 keeps 1 and 2 (the first two reach 0.5).
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5))) == {1, 2}
    assert len(draws(SamplingParams(temperature=1.0))) >= 3


def test_the_same_seed_draws_the_same_tokens() -> None:
    params = SamplingParams(temperature=1.5)
    a = [sample(LOGITS, [params], [g])[0] for g in [make_generator(7)] for _ in range(50)]
    b = [sample(LOGITS, [params], [g])[0] for g in [make_generator(7)] for _ in range(50)]
    assert a == b


def feed(detok: IncrementalDetokenizer, text: str) -> str:
    out = []
    for byte in text.encode():
        detok.add(byte)
        out.append(detok.take())
        if detok.stopped:
            break
    out.append(detok.take(final=True))
    return "".join(out)


def test_multi_byte_characters_arrive_whole() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    pieces = []
    for byte in "héllo ✓".encode():
        detok.add(byte)
        pieces.append(detok.take())
    assert "".join(pieces) == "héllo ✓" and "\ufffd" not in "".join(pieces)


def test_stop_strings_cut_the_text_even_across_tokens() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("END", "xyz"))
    assert feed(detok, "abc ENDING more") == "abc " and detok.stopped
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("xyz",))
    assert feed(detok, "no stop here") == "no stop here" and not detok.stopped


def test_an_unfinished_character_at_the_end_still_goes_out() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    detok.add(ord("a"))
    detok.add("é".encode()[0])  # the first byte of a two-byte character, and then the answer ends
    assert detok.take() == "a"
    assert detok.take(final=True) == "\ufffd"
