"""Each Triton kernel against its torch reference, run by Triton's interpreter on tiny shapes (CPU).

The interpreter has no bfloat16 arithmetic, so the kernels compute in float32 and round where the torch
ops round; bf16/fp16 cases check loads, stores and those roundings (attention's dots run in float32 there,
in the input dtype on a GPU: tests/gpu covers that). Full-size shapes on CUDA are in tests/gpu.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from engine.attention import KVCache, SeqSlice, build_metadata, paged_attention
from engine.kernels import ops
from engine.kernels.activation import silu_and_mul_torch, silu_and_mul_triton
from engine.kernels.attention_decode import paged_decode_attention_torch, paged_decode_attention_triton
from engine.kernels.attention_prefill import paged_prefill_attention_torch, paged_prefill_attention_triton
from engine.kernels.errors import KernelInputError
from engine.kernels.kv_store import store_kv_torch, store_kv_triton
from engine.kernels.norm import rms_norm_torch, rms_norm_triton
from engine.kernels.rotary import rotary_torch, rotary_triton
from engine.kernels.triton_support import interpreter_usable
from tests.kernel_cases import TOLERANCE, greedy, int32, paged_cache, query_start, randn, tiny_qwen3

pytest.importorskip("triton")
if not interpreter_usable():  # a GPU machine: Triton compiles there, and tests/gpu runs these kernels
    pytest.skip(
        "Triton was imported in compiled mode (see tests/triton_interpret.py)", allow_module_level=True
    )

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HALF = [torch.float16, torch.bfloat16]
BLOCK = 8


@pytest.fixture(autouse=True)
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton runs on CPU tensors through its interpreter (read at each launch, see triton_support)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    # The interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest: twice the tolerance
    tol = TOLERANCE[dtype] * (2 if dtype == torch.bfloat16 else 1)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
def test_rms_norm(dtype: torch.dtype, fused: bool) -> None:
    g = gen()
    x = randn((3, 5, 48), dtype, "cpu", g)  # 48 columns: a masked tail in the 64-wide block
    residual = randn((3, 5, 48), dtype, "cpu", g) if fused else None
    weight = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    out, total = rms_norm_triton(x, weight, 1e-6, residual)
    ref_out, ref_total = rms_norm_torch(x, weight, 1e-6, residual)
    # the sum is rounded once to the input dtype, as torch rounds it: bit for bit (bf16 within its truncation
    # by the interpreter; tests/gpu checks bf16 bit for bit)
    tol = 2**-7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(total, ref_total, atol=0, rtol=tol)
    close(out, ref_out, dtype)


def rope_cos_sin(positions: list[int], dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.tensor(positions).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_views_of_a_merged_projection(dtype: torch.dtype) -> None:
    t, q_heads, kv_heads, dim = 7, 6, 2, 24  # 6 heads and half-dim 12: masked rows and columns
    qkv = randn((t, (q_heads + 2 * kv_heads) * dim), dtype, "cpu", gen())
    q = qkv[:, : q_heads * dim].view(t, q_heads, dim)  # strided rows, as a fused qkv_proj gives them
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(t, kv_heads, dim)
    cos, sin = rope_cos_sin([0, 1, 2, 40, 41, 7, 1000], dim, dtype)  # several sequences' positions
    q_out, k_out = rotary_triton(q, k, cos, sin)
    # the kernel rounds once from float32; the reference, computed in float32 on the same inputs, too
    ref_q, ref_k = rotary_torch(q.float(), k.float(), cos.float(), sin.float())
    close(q_out, ref_q.to(dtype), dtype)
    close(k_out, ref_k.to(dtype), dtype)
    assert torch.equal(qkv[:, : q_heads * dim].view(t, q_heads, dim), q)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_halves_of_one_tensor(dtype: torch.dtype) -> None:
    merged = 3 * randn((5, 80), dtype, "cpu", gen())
    gate, up = merged[:, :40], merged[:, 40:]
    out = silu_and_mul_triton(gate, up)
    close(out, silu_and_mul_torch(gate, up), dtype)


# float32 K/V into a float16 cache: the cast rounds to nearest here as on a GPU (the interpreter truncates to
# bfloat16, which tests/gpu covers)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_store_kv_writes_each_token_to_its_slot(cache_dtype: torch.dtype) -> None:
    g = gen()
    kv = randn((6, 2 * 2 * 24), torch.float32, "cpu", g)
    k, v = kv[:, :48].view(6, 2, 24), kv[:, 48:].view(6, 2, 24)
    k_cache, v_cache = randn((40, 2, 24), cache_dtype, "cpu", g), randn((40, 2, 24), cache_dtype, "cpu", g)
    slots = torch.randperm(40, generator=g)[:6]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_torch(k, v, ref_k, ref_v, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # other slots untouched too


LENGTHS = [1, 7, 16, 37]  # blocks of 8: a lone token, partial pages, exactly two pages, five pages


def decode_case(
    q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, Any, torch.Tensor]:
    g = gen(1)
    cache = paged_cache(LENGTHS, BLOCK, kv_heads, dim, dtype, "cpu", g)
    return randn((len(LENGTHS), q_heads, dim), dtype, "cpu", g), cache, int32(LENGTHS, "cpu")


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "gqa6-mqa"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_attention(heads: tuple[int, int], num_splits: int) -> None:
    dim = 24 if heads[1] == 1 else 16  # 24: a masked head dimension
    q, c, lens = decode_case(*heads, dim, torch.float32)
    args = (q, c.k_cache, c.v_cache, c.block_tables, lens, BLOCK, dim**-0.5)
    out = paged_decode_attention_triton(*args, num_splits=num_splits)  # 3 splits: some empty (length 1)
    close(out, paged_decode_attention_torch(*args), torch.float32)


@pytest.mark.parametrize("dtype", HALF)
def test_paged_decode_attention_half_precision(dtype: torch.dtype) -> None:
    q, c, lens = decode_case(8, 2, 16, dtype)
    args = (q, c.k_cache, c.v_cache, c.block_tables, lens, BLOCK, 0.25)
    close(paged_decode_attention_triton(*args, num_splits=2), paged_decode_attention_torch(*args), dtype)


def test_paged_decode_split_merge_reads_no_masked_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a masked load without ``other=`` leaves its masked lanes undefined; the interpreter fills them
    with zeros, which would hide it. Here they hold NaN: 3 splits (a block of 4 lanes) and a head dimension of
    24 (a block of 32) must still give the reference."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_masked_load

    def poisoned(self: Any, ptrs: Any, mask: Any, other: Any, *rest: Any) -> Any:
        element = ptrs.get_element_ty()
        if other is None and element.is_floating():
            nan = np.full(ptrs.data.shape, np.nan, dtype=interpreter._get_np_dtype(element))
            other = interpreter.TensorHandle(nan, element)
        return original(self, ptrs, mask, other, *rest)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", poisoned)
    g = gen(2)
    lengths = [1, 20]  # a lone token: two of its three splits are empty
    cache = paged_cache(lengths, BLOCK, 1, 24, torch.float32, "cpu", g)
    q = randn((len(lengths), 2, 24), torch.float32, "cpu", g)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, int32(lengths, "cpu"), BLOCK, 24**-0.5)
    close(
        paged_decode_attention_triton(*args, num_splits=3), paged_decode_attention_torch(*args), torch.float32
    )


# (tokens already cached, new tokens) per sequence: a fresh prompt over two query blocks, a chunk after a
# partial page, a decode token riding along, a chunk after exactly one page
PREFILL = [(0, 19), (13, 5), (16, 1), (8, 17)]


def prefill_args(q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> tuple[Any, ...]:
    g = gen(2)
    cache = paged_cache([p + n for p, n in PREFILL], BLOCK, kv_heads, dim, dtype, "cpu", g)
    tokens = sum(n for _, n in PREFILL)
    q = randn((tokens, q_heads, dim), dtype, "cpu", g)
    kv = randn((tokens, 2, kv_heads, dim), dtype, "cpu", g)  # k and v interleaved: strided rows
    starts, prefix = query_start([n for _, n in PREFILL], "cpu"), int32([p for p, _ in PREFILL], "cpu")
    return (q, kv[:, 0], kv[:, 1], cache.k_cache, cache.v_cache, cache.block_tables, starts, prefix, BLOCK)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "gqa6-mqa"])
def test_paged_prefill_attention(heads: tuple[int, int]) -> None:
    args = (*prefill_args(*heads, 16, torch.float32), 0.25)
    close(paged_prefill_attention_triton(*args), paged_prefill_attention_torch(*args), torch.float32)


@pytest.mark.parametrize("dtype", HALF)
def test_paged_prefill_attention_half_precision(dtype: torch.dtype) -> None:
    args = (*prefill_args(8, 2, 24, dtype), 24**-0.5)
    close(paged_prefill_attention_triton(*args), paged_prefill_attention_torch(*args), dtype)


def test_dispatch_follows_the_device_and_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.ones(2, 8)
    assert ops.use_triton(x)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not ops.use_triton(x)


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["triton", "torch"])
def test_bad_inputs_raise_a_named_error(monkeypatch: pytest.MonkeyPatch, interpret: str) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    x = torch.ones(4, 8)
    with pytest.raises(KernelInputError, match="weight"):
        ops.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(KernelInputError, match="cos"):
        ops.rotary(torch.ones(4, 2, 8), torch.ones(4, 1, 8), torch.ones(4, 6), torch.ones(4, 6))
    with pytest.raises(KernelInputError, match="gate"):
        ops.silu_and_mul(x, torch.ones(4, 9))
    with pytest.raises(KernelInputError, match="slot_mapping"):
        ops.store_kv(torch.ones(4, 2, 8), torch.ones(4, 2, 8), torch.ones(16, 2, 8), torch.ones(16, 2, 8), x)
    cache = torch.ones(16, 2, 8)
    tables, lens = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="group"):
        ops.paged_decode_attention(torch.ones(3, 5, 8), cache, cache, tables, lens, 8, 1.0)
    with pytest.raises(KernelInputError, match="block_tables"):
        ops.paged_decode_attention(torch.ones(3, 4, 8), cache, cache, tables[:2], lens, 8, 1.0)
    kv = torch.ones(4, 2, 8)
    with pytest.raises(KernelInputError, match="query_start"):
        ops.paged_prefill_attention(torch.ones(4, 4, 8), kv, kv, cache, cache, tables, lens, lens, 8, 1.0)


def run_both_paths(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn`` once through the torch path and once through the Triton kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch_result = fn()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch_result, fn()


def test_engine_attention_steps_through_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """paged_attention over a prompt step, a mixed chunk + decode step and a decode step: the kernels (the
    prompt through the prefill kernel, the mixed step's chunk through it and its decode row through the
    decode kernel, then the decode kernel) give the SDPA path's outputs and caches."""
    calls: dict[str, int] = {"decode": 0, "prefill": 0}

    def counting(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(
        ops, "paged_decode_attention_triton", counting("decode", ops.paged_decode_attention_triton)
    )
    monkeypatch.setattr(
        ops, "paged_prefill_attention_triton", counting("prefill", ops.paged_prefill_attention_triton)
    )
    heads, kv_heads, dim = 4, 2, 16
    table_a, table_b = [5, 0, 9, 2], [7, 3, 1]
    steps = [
        [SeqSlice(table_a, 0, 19), SeqSlice(table_b, 0, 10)],
        [SeqSlice(table_a, 19, 1), SeqSlice(table_b, 10, 6)],
        [SeqSlice(table_a, 20, 1), SeqSlice(table_b, 16, 1)],
    ]
    g = gen(3)
    caches = [KVCache(1, 12, BLOCK, kv_heads, dim, torch.float32) for _ in range(2)]
    for slices in steps:
        meta = build_metadata(slices, BLOCK)
        t = meta.num_tokens
        q, k, v = (randn((t, h, dim), torch.float32, "cpu", g) for h in (heads, kv_heads, kv_heads))
        paths = iter(caches)

        def attend(q: Any = q, k: Any = k, v: Any = v, meta: Any = meta, paths: Any = paths) -> Any:
            return paged_attention(q, k, v, *next(paths).layer(0), meta, dim**-0.5)

        ours_torch, ours_triton = run_both_paths(monkeypatch, attend)
        close(ours_triton, ours_torch, torch.float32)
        assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    assert calls == {"prefill": 2, "decode": 2}


def test_model_through_the_kernels_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3-style model (q/k norms, GQA): same logits and greedy tokens through either path."""
    model = tiny_qwen3("cpu")
    (torch_logits, torch_tokens), (triton_logits, triton_tokens) = run_both_paths(
        monkeypatch, lambda: greedy(model, steps=4)
    )
    assert triton_tokens == torch_tokens
    for ours, theirs in zip(triton_logits, torch_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
