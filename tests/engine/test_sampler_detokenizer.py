"""Sampling parameters do what they say; text deltas survive multi-byte characters and stop strings."""

from __future__ import annotations

from collections import Counter

import torch

from cache.tokens import ByteTokenizer
from engine.detokenizer import IncrementalDetokenizer
from engine.sampler import Sampler
from engine.sequence import SamplingParams, Sequence

LOGITS = torch.tensor([[0.0, 3.0, 2.9, 2.8, -5.0]])


def draws(params: SamplingParams, n: int = 400) -> list[int]:
    """``n`` tokens drawn one step at a time by one sequence (the sampler consumes its logits: copies)."""
    sampler = Sampler(LOGITS.shape[1])
    seq = Sequence("r", [0], params, 0)
    return [sampler.sample(LOGITS.clone(), [seq]).token_ids[0] for _ in range(n)]


def test_greedy_and_top_k_one_take_the_argmax() -> None:
    assert Counter(draws(SamplingParams(temperature=0.0))) == Counter({1: 400})
    assert Counter(draws(SamplingParams(temperature=1.0, top_k=1))) == Counter({1: 400})


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    assert set(draws(SamplingParams(temperature=1.0, top_k=2))) == {1, 2}
    # Tokens 1, 2, 3 hold ~0.97 of the mass: top_p 0.5 keeps 1 and 2 (the first two reach 0.5).
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5))) == {1, 2}
    assert len(set(draws(SamplingParams(temperature=1.0)))) >= 3
    # min_p 0.9: only tokens at least 0.9 as likely as token 1 (e^-0.1 = 0.905: token 2, not 3).
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.9))) == {1, 2}


def test_the_same_seed_draws_the_same_tokens() -> None:
    params = SamplingParams(temperature=1.5, seed=7)
    assert draws(params, 50) == draws(params, 50)
    assert draws(params, 50) != draws(SamplingParams(temperature=1.5, seed=8), 50)


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


def test_stop_strings_wait_for_min_tokens() -> None:
    # As vLLM: no stop string ends the text before more than min_tokens tokens are out, and one that ended
    # before stays (only text that ends in new tokens is looked at).
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("ab",), min_tokens=4)
    assert feed(detok, "abcab tail") == "abc" and detok.stopped
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("ab",), min_tokens=2)
    assert feed(detok, "xab tail") == "x" and detok.stopped  # "ab" ends at the third token: found
