"""The real engine end to end (no HTTP): batching, paging and prefix caching never change the tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cache.events import BlockStored
from cache.hashing import namespace_seed, namespaced_block_hashes
from engine.engine_types import RequestRejected
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_runner import ModelRunner
from engine.sequence import CacheNamespace, SamplingParams, Sequence

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def engine(model_dir: Path, **overrides: object) -> LLMEngine:
    options: dict[str, object] = {"block_size": 4, "num_kv_blocks": 256, "device": "cpu", **overrides}
    return LLMEngine(EngineConfig(str(model_dir), **options))  # type: ignore[arg-type]


def prompts(vocab: int) -> list[list[int]]:
    lengths = (5, 17, 30, 9)
    return [[(7 * i + 13 * j + 3) % vocab for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def single_runs(tiny_model_dir: Path) -> list[list[int]]:
    """Each prompt alone, in a fresh engine, whole prompt in one step: the reference."""
    out = []
    for p in prompts(engine(tiny_model_dir).model_config.vocab_size):
        out.append(engine(tiny_model_dir).generate([p], GREEDY)[0])
    return out


def test_batched_runs_give_exactly_the_single_run_tokens(
    tiny_model_dir: Path, single_runs: list[list[int]]
) -> None:
    e = engine(tiny_model_dir)
    assert e.generate(prompts(e.model_config.vocab_size), GREEDY) == single_runs


def test_chunked_prefill_and_preemption_give_the_same_tokens(
    tiny_model_dir: Path, single_runs: list[list[int]]
) -> None:
    # An 8-token budget chunks every prompt; 24 blocks of 4 cannot hold all four sequences at full length.
    e = engine(tiny_model_dir, max_num_batched_tokens=8, num_kv_blocks=24)
    assert e.generate(prompts(e.model_config.vocab_size), GREEDY) == single_runs
    assert e.scheduler.preemptions > 0


def test_warming_up_writes_only_the_scratch_block(tiny_model_dir: Path, single_runs: list[list[int]]) -> None:
    e = engine(tiny_model_dir, max_num_batched_tokens=100)
    assert e.kv_cache is not None
    block = e.config.block_size
    scratch = slice(e.blocks.num_blocks * block, None)  # the last block: the block manager never has it
    before = [t.clone() for t in e.kv_cache.k]
    e.warm_up()
    for old, new in zip(before, e.kv_cache.k, strict=True):
        assert torch.equal(old[: scratch.start], new[: scratch.start]) and not torch.equal(
            old[scratch], new[scratch]
        )
    assert e.generate(prompts(e.model_config.vocab_size), GREEDY) == single_runs


def test_a_cpu_engine_loads_on_one_thread_and_gives_torch_its_threads_back(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine import llm_engine

    seen: list[int] = []
    load = llm_engine.load_model

    def load_counting_threads(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return load(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "load_model", load_counting_threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine(tiny_model_dir)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_prefix_cached_runs_give_the_same_tokens(tiny_model_dir: Path, single_runs: list[list[int]]) -> None:
    e = engine(tiny_model_dir)
    ps = prompts(e.model_config.vocab_size)
    e.generate(ps, GREEDY)  # warm the prefix cache
    again = e.generate(ps, GREEDY)
    assert again == single_runs


def test_a_shared_three_block_prefix_is_reported_and_not_recomputed(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir)
    vocab = e.model_config.vocab_size
    prefix = [(5 * j + 1) % vocab for j in range(12)]  # 3 blocks of 4
    e.generate([[*prefix, 1, 2]], SamplingParams(max_tokens=2, temperature=0.0))
    computed: list[int] = []
    run = e.runner.run

    def counting(batch):  # type: ignore[no-untyped-def]
        computed.extend(item.num_new for item in batch)
        return run(batch)

    e.runner.run = counting  # type: ignore[method-assign]
    e.add_request("second", [*prefix, 9, 8, 7], SamplingParams(max_tokens=1, temperature=0.0))
    outs = []
    while e.has_work():
        outs.extend(e.step())
    assert outs[-1].cached_tokens == 12 and outs[-1].prompt_tokens == 15
    assert computed == [3]  # only the 3 uncached tokens went through the model


def test_the_same_seed_gives_the_same_sample(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir)
    p = prompts(e.model_config.vocab_size)[1]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    first = e.generate([p], params)[0]
    # Again, now batched with other work: a per-sequence generator is unaffected by its neighbours.
    batch = e.generate([prompts(e.model_config.vocab_size)[0], p], [GREEDY, params])[1]
    assert first == batch
    other = e.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other != first


def test_stop_strings_max_tokens_and_eos(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir)
    p = prompts(e.model_config.vocab_size)[2]
    e.add_request("len", p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    outs = []
    while e.has_work():
        outs.extend(e.step())
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 5
    full_text = "".join(o.text for o in outs)
    assert full_text
    stop = full_text[1:3] if len(full_text) >= 3 else full_text[:1]
    e.add_request("stop", p, SamplingParams(max_tokens=5, temperature=0.0, stop=(stop,), ignore_eos=True))
    outs = []
    while e.has_work():
        outs.extend(e.step())
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop" and stop not in text and full_text.startswith(text)
    # End of sequence: make the model's favourite next token the EOS and it stops at once.
    greedy_first = e.generate([p], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0][0]
    e.eos_token_ids = frozenset({greedy_first})
    e.add_request("eos", p, SamplingParams(max_tokens=5, temperature=0.0))
    outs = []
    while e.has_work():
        outs.extend(e.step())
    assert outs[-1].finish_reason == "stop" and outs[-1].completion_tokens == 1


def test_kv_events_describe_the_prefix_cache(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir)
    e.generate([list(range(1, 11))], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    stored = [h for ev in e.blocks.drain_events() if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert set(stored) == set(e.blocks.cached_hashes()) and len(stored) == (10 + 3 - 1) // 4


def test_requests_that_can_never_fit_are_rejected(tiny_model_dir: Path) -> None:
    # A context configured past the cache (the operator's choice) leaves the KV-block check to refuse.
    e = engine(tiny_model_dir, num_kv_blocks=4, max_model_len=64)
    with pytest.raises(RequestRejected, match="KV blocks"):
        e.add_request("big", list(range(1, 20)), SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match="vocabulary"):
        e.add_request("oov", [10**6], SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match="empty"):
        e.add_request("empty", [], SamplingParams(max_tokens=1))


def test_an_unset_context_is_what_the_kv_cache_holds_when_the_model_allows_more(tiny_model_dir: Path) -> None:
    # A chat without max_tokens may fill the context (engine.openai_api), so the context must fit the cache.
    small = engine(tiny_model_dir, num_kv_blocks=4)
    assert small.model_config.max_position_embeddings > 16 and small.max_model_len == 16
    small.check_request(list(range(1, 6)), SamplingParams(max_tokens=small.max_model_len - 5))
    # The decode graphs are sized by the runner's context: the model's whole one would make the graphed
    # attention run splits for blocks no sequence can have.
    assert isinstance(small.runner, ModelRunner) and small.runner.max_model_len == 16
    roomy = engine(tiny_model_dir, num_kv_blocks=4096)
    assert roomy.max_model_len == roomy.model_config.max_position_embeddings
    assert engine(tiny_model_dir, num_kv_blocks=4, max_model_len=64).max_model_len == 64  # configured: kept


def test_qwen3_runs_through_the_engine(tiny_qwen3_dir: Path) -> None:
    e = engine(tiny_qwen3_dir)
    single = e.generate([prompts(e.model_config.vocab_size)[1]], GREEDY)
    batched = engine(tiny_qwen3_dir).generate(prompts(e.model_config.vocab_size), GREEDY)
    assert batched[1] == single[0]


def test_cache_salts_keep_tenants_apart_but_share_the_public_prefix(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir)
    vocab = e.model_config.vocab_size
    system = [(5 * j + 1) % vocab for j in range(16)]  # 4 blocks of 4: the declared public prefix
    question = [(11 * j + 2) % vocab for j in range(9)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def cached(request_id: str, salt: str, shared: int) -> int:
        e.add_request(request_id, system + question, params, CacheNamespace(salt, shared))
        hits = []
        while e.has_work():
            hits += [o.cached_tokens for o in e.step() if o.request_id == request_id and o.finished]
        return hits[0]

    assert cached("a1", "acme", 4) == 0
    assert cached("a2", "acme", 4) == 24  # its own full blocks (the last prompt token is always computed)
    assert cached("g1", "globex", 4) == 16  # the public part only: acme's question stays acme's
    assert cached("n1", "", 0) == 16  # the public namespace is the salt-less one: only the public part
    # The engine's incremental hashes are the gateway's (contract 1), across the public/private seam.
    seq = Sequence("x", system + question + [1, 2, 3], params, namespace_seed(e.model_name, "acme"))
    seq.public_seed, seq.shared_blocks = namespace_seed(e.model_name, ""), 4
    assert seq.block_hashes(4) == namespaced_block_hashes(
        np.asarray(seq.token_ids, dtype=np.uint32),
        4,
        seq.hash_seed,
        public_seed=seq.public_seed,
        shared_blocks=4,
    )


def test_the_kv_cache_is_sized_by_the_options(tiny_model_dir: Path) -> None:
    from engine.kv_cache_sizing import DEFAULT_KV_MEMORY_GIB

    default = engine(tiny_model_dir, num_kv_blocks=None)  # on CPU: nothing to profile, the default size
    half = engine(tiny_model_dir, num_kv_blocks=None, kv_memory_gib=DEFAULT_KV_MEMORY_GIB / 2)
    assert default.blocks.num_blocks > 1 and half.blocks.num_blocks == default.blocks.num_blocks // 2
    assert engine(tiny_model_dir, num_kv_blocks=7, kv_memory_gib=1.0).blocks.num_blocks == 7
