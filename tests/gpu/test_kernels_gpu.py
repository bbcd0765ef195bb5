"""The Triton kernels compiled on a GPU, at full size, against their torch references (skipped without
CUDA). Shapes are those of an 8B Llama-class model: 32 query heads over 8 KV heads of dim 128, pages of 16.

On a GPU, attention's dots run in the input dtype (tensor cores) and float32 -> bfloat16 casts round to
nearest, so bf16 results are held to the same tolerances as in tests/engine/test_kernels.py, and the fused
residual sum bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import ops
from engine.kernels.activation import silu_and_mul_torch, silu_and_mul_triton
from engine.kernels.attention_decode import paged_decode_attention_torch, paged_decode_attention_triton
from engine.kernels.attention_prefill import paged_prefill_attention_torch, paged_prefill_attention_triton
from engine.kernels.kv_store import store_kv_torch, store_kv_triton
from engine.kernels.norm import rms_norm_torch, rms_norm_triton
from engine.kernels.rotary import rotary_torch, rotary_triton
from tests.kernel_cases import TOLERANCE, greedy, int32, paged_cache, query_start, randn, tiny_qwen3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
TOKENS, HIDDEN, INTERMEDIATE = 4096, 4096, 14336
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE_BATCH, LONGEST = 64, 4096
HALF = [torch.bfloat16, torch.float16]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", HALF)
def test_rms_norm_with_residual(dtype: torch.dtype) -> None:
    g = gen()
    x, residual = (randn((TOKENS, HIDDEN), dtype, DEVICE, g) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(DEVICE, dtype)
    out, total = rms_norm_triton(x, weight, 1e-6, residual)
    ref_out, ref_total = rms_norm_torch(x, weight, 1e-6, residual)
    assert torch.equal(total, ref_total)
    close(out, ref_out, dtype)
    close(rms_norm_triton(x, weight, 1e-6)[0], rms_norm_torch(x, weight, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_rotary(dtype: torch.dtype) -> None:
    g = gen()
    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = randn((TOKENS, width), dtype, DEVICE, g)
    q = qkv[:, : Q_HEADS * HEAD_DIM].view(TOKENS, Q_HEADS, HEAD_DIM)
    k = qkv[:, Q_HEADS * HEAD_DIM : (Q_HEADS + KV_HEADS) * HEAD_DIM].view(TOKENS, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 32768, (TOKENS,), generator=g).float()
    inv_freq = 1.0 / 500000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    emb = (positions[:, None] * inv_freq).repeat(1, 2).to(DEVICE)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_out, k_out = rotary_triton(q, k, cos, sin)
    ref_q, ref_k = rotary_torch(q.float(), k.float(), cos.float(), sin.float())
    close(q_out, ref_q.to(dtype), dtype)
    close(k_out, ref_k.to(dtype), dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    merged = 3 * randn((TOKENS, 2 * INTERMEDIATE), dtype, DEVICE, gen())
    gate, up = merged[:, :INTERMEDIATE], merged[:, INTERMEDIATE:]
    close(silu_and_mul_triton(gate, up), silu_and_mul_torch(gate, up), dtype)


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_store_kv_into_a_bf16_cache(source: torch.dtype) -> None:
    g = gen()
    slots_total = 4 * TOKENS
    kv = randn((TOKENS, 2 * KV_HEADS * HEAD_DIM), source, DEVICE, g)
    k = kv[:, : KV_HEADS * HEAD_DIM].view(TOKENS, KV_HEADS, HEAD_DIM)
    v = kv[:, KV_HEADS * HEAD_DIM :].view(TOKENS, KV_HEADS, HEAD_DIM)
    shape = (slots_total, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = randn(shape, torch.bfloat16, DEVICE, g), randn(shape, torch.bfloat16, DEVICE, g)
    slots = torch.randperm(slots_total, generator=g)[:TOKENS].to(DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_torch(k, v, ref_k, ref_v, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 7])  # None: the heuristic's choice
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
def test_paged_decode_attention(dtype: torch.dtype, num_splits: int | None, head_dim: int) -> None:
    g = gen(1)
    lengths = [1, 15, 16, 17, LONGEST, *torch.randint(1, LONGEST, (DECODE_BATCH - 5,), generator=g).tolist()]
    cache = paged_cache(lengths, BLOCK, KV_HEADS, head_dim, dtype, DEVICE, g)
    q = randn((DECODE_BATCH, Q_HEADS, head_dim), dtype, DEVICE, g)
    args = (
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        int32(lengths, DEVICE),
        BLOCK,
        head_dim**-0.5,
    )
    out = paged_decode_attention_triton(*args, max_context_len=max(lengths), num_splits=num_splits)
    close(out, paged_decode_attention_torch(*args), dtype)


def test_paged_decode_attention_small_batch_long_context() -> None:
    """One long sequence: the heuristic splits its context across the GPU (flash decoding)."""
    g = gen(2)
    cache = paged_cache([32768], BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, DEVICE, g)
    q = randn((1, Q_HEADS, HEAD_DIM), torch.bfloat16, DEVICE, g)
    args = (
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        int32([32768], DEVICE),
        BLOCK,
        HEAD_DIM**-0.5,
    )
    close(paged_decode_attention_triton(*args), paged_decode_attention_torch(*args), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 256])
def test_paged_prefill_attention(dtype: torch.dtype, head_dim: int) -> None:
    g = gen(3)
    # (cached, new): a fresh prompt, chunks after partial and full pages, decode tokens riding along
    seqs = [(0, 1024), (1000, 300), (2048, 1), (17, 777), (4096, 512), (5, 1)]
    cache = paged_cache([p + n for p, n in seqs], BLOCK, KV_HEADS, head_dim, dtype, DEVICE, g)
    tokens = sum(n for _, n in seqs)
    q = randn((tokens, Q_HEADS, head_dim), dtype, DEVICE, g)
    kv = randn((tokens, 2, KV_HEADS, head_dim), dtype, DEVICE, g)
    starts, prefix = query_start([n for _, n in seqs], DEVICE), int32([p for p, _ in seqs], DEVICE)
    args = (q, kv[:, 0], kv[:, 1], cache.k_cache, cache.v_cache, cache.block_tables, starts, prefix, BLOCK)
    out = paged_prefill_attention_triton(*args, head_dim**-0.5, max_query_len=1024)
    close(out, paged_prefill_attention_torch(*args, head_dim**-0.5), dtype)


def test_model_on_the_gpu_kernels_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny model on CUDA: the Triton kernels give the torch path's logits and greedy tokens."""
    model = tiny_qwen3(DEVICE)
    triton_logits, triton_tokens = greedy(model, steps=6)
    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    torch_logits, torch_tokens = greedy(model, steps=6)
    assert triton_tokens == torch_tokens
    for ours, theirs in zip(triton_logits, torch_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
