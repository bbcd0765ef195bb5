"""Mixed steps (decode rows beside prefill chunks): the decode rows go through the decode kernel, the chunks
through the prefill kernel, and together they give what the prefill path gives for every row; on the torch
references, on the Triton kernels in the interpreter (tiny shapes), and end to end in the engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import attention
from engine.attention import KVCache, SeqSlice, build_metadata, kernel_attention
from engine.kernels import attention_decode, ops
from engine.kernels.attention_prefill import paged_prefill_attention_torch
from engine.kernels.triton_support import interpreter_usable
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import SamplingParams
from engine.step_metadata import StepMetadata
from tests.kernel_cases import randn

BLOCK = 8
HEADS, KV_HEADS, DIM = 4, 2, 16  # a group of 2 query heads per KV head
# Rows interleaved so the decode rows are not contiguous: a decode token at context 37 (two splits of 32
# and 5 keys in the interpreter's 16-key tiles), a prefill chunk of 6 after a 13-token cached prefix, a
# decode token at context 5 (its second split empty), a fresh 3-token prompt.
STEP = [(36, 1), (13, 6), (4, 1), (0, 3)]


def mixed_step(seed: int = 0) -> tuple[list[SeqSlice], KVCache, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(done + new) // BLOCK) for done, new in STEP]
    order = torch.randperm(sum(needed) + 2, generator=g).tolist()  # blocks scattered, two spare
    slices, used = [], 0
    for (done, new), n in zip(STEP, needed, strict=True):
        slices.append(SeqSlice(order[used : used + n], done, new))
        used += n
    cache = KVCache(1, len(order), BLOCK, KV_HEADS, DIM, torch.float32)
    cache.k[0].copy_(randn(tuple(cache.k[0].shape), torch.float32, "cpu", g))  # cached prefixes: random
    cache.v[0].copy_(randn(tuple(cache.v[0].shape), torch.float32, "cpu", g))
    tokens = sum(new for _, new in STEP)
    qkv = tuple(randn((tokens, h, DIM), torch.float32, "cpu", g) for h in (HEADS, KV_HEADS, KV_HEADS))
    return slices, cache, qkv


def every_row_through_prefill(meta: attention.AttentionMetadata, cache: KVCache, qkv: Any) -> torch.Tensor:
    """The old path: the prefill reference for all rows, decode rows included."""
    q, k, v = qkv
    k_cache, v_cache = cache.layer(0)
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_prefill_attention_torch(
        q, k, v, k_cache, v_cache, meta.block_tables, meta.query_start, meta.prefix_lens, BLOCK, DIM**-0.5
    )


def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Records each ops attention call's batch (decode) or seq_ids (prefill)."""
    calls: dict[str, list[Any]] = {"decode": [], "prefill": []}
    decode, prefill = ops.paged_decode_attention, ops.paged_prefill_attention

    def decode_call(q: torch.Tensor, *args: Any) -> torch.Tensor:
        calls["decode"].append(q.shape[0])
        return decode(q, *args)

    def prefill_call(*args: Any) -> torch.Tensor:
        calls["prefill"].append(args[11].tolist() if len(args) > 11 and args[11] is not None else None)
        return prefill(*args)

    monkeypatch.setattr(ops, "paged_decode_attention", decode_call)
    monkeypatch.setattr(ops, "paged_prefill_attention", prefill_call)
    return calls


def ours(meta: attention.AttentionMetadata, cache: KVCache, qkv: Any) -> torch.Tensor:
    q, k, v = qkv
    k_cache, v_cache = cache.layer(0)
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return kernel_attention(q, k, v, k_cache, v_cache, meta, DIM**-0.5)


def builders() -> list[Callable[[list[SeqSlice]], attention.AttentionMetadata]]:
    def persistent(slices: list[SeqSlice]) -> attention.AttentionMetadata:
        step = StepMetadata(BLOCK, max_num_seqs=2, max_blocks=2)  # grows to fit
        seqs = [(object(), list(s.block_table), s.num_computed, s.num_new) for s in slices]
        return step.build(seqs)[0]

    return [lambda slices: build_metadata(slices, BLOCK), persistent]


@pytest.mark.parametrize("build", builders(), ids=["build_metadata", "StepMetadata"])
def test_mixed_step_on_the_torch_references(monkeypatch: pytest.MonkeyPatch, build: Any) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    slices, cache, qkv = mixed_step()
    meta = build(slices)
    assert meta.mixed is not None
    assert meta.mixed.decode_rows.tolist() == [0, 7] and meta.mixed.prefill_seqs.tolist() == [1, 3]
    expected = every_row_through_prefill(meta, cache, qkv)
    calls = counted(monkeypatch)
    torch.testing.assert_close(ours(meta, cache, qkv), expected, atol=2e-5, rtol=2e-5)
    assert calls == {"decode": [2], "prefill": [[1, 3]]}


@pytest.mark.skipif(
    not interpreter_usable(), reason="Triton compiled (a GPU machine) or absent: tests/gpu covers it"
)
@pytest.mark.parametrize("build", builders(), ids=["build_metadata", "StepMetadata"])
def test_mixed_step_on_the_triton_kernels(monkeypatch: pytest.MonkeyPatch, build: Any) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Two splits whatever the device: context 37 crosses the boundary, context 5 leaves split 1 empty
    monkeypatch.setattr(attention_decode, "default_num_splits", lambda *_: 2)
    slices, cache, qkv = mixed_step(1)
    meta = build(slices)
    expected = every_row_through_prefill(meta, cache, qkv)
    calls = counted(monkeypatch)
    torch.testing.assert_close(ours(meta, cache, qkv), expected, atol=2e-5, rtol=2e-5)
    assert calls == {"decode": [2], "prefill": [[1, 3]]}


def test_pure_steps_are_not_split() -> None:
    assert build_metadata([SeqSlice([1], 3, 1), SeqSlice([2], 0, 1)], BLOCK).mixed is None
    assert build_metadata([SeqSlice([1], 0, 4), SeqSlice([2, 3], 6, 3)], BLOCK).mixed is None


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_engine_mixed_steps_give_the_single_run_tokens(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    """The engine's kernel path (ops' torch references on CPU): chunked prefill beside decoding sequences,
    split between the two kernels, gives each prompt's tokens from running it alone."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(attention, "_use_kernels", lambda q: True)
    calls = counted(monkeypatch)

    def engine(**overrides: object) -> LLMEngine:
        options: dict[str, object] = {"block_size": 4, "num_kv_blocks": 128, "device": "cpu", **overrides}
        return LLMEngine(EngineConfig(str(tiny_model_dir), **options))  # type: ignore[arg-type]

    vocab = engine().model_config.vocab_size
    prompts = [[(7 * i + 13 * j + 3) % vocab for j in range(n)] for i, n in enumerate((5, 17, 30, 9))]
    single = [engine().generate([p], GREEDY)[0] for p in prompts]
    calls["prefill"].clear()
    # An 8-token budget: later prompts are chunked while the first ones decode
    assert engine(max_num_batched_tokens=8).generate(prompts, GREEDY) == single
    assert any(ids is not None for ids in calls["prefill"]), "no mixed step was split"
