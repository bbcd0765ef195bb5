"""pack_linears: every linear of a CPU model through oneDNN's packed GEMM, computing what F.linear does."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine.model.packed_linear import PackedLinear, can_pack, pack_linears
from tests.kernel_cases import greedy, tiny_qwen3

pytestmark = pytest.mark.skipif(not can_pack(), reason="this torch has no oneDNN packed linear")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_packed_linear_computes_f_linear(dtype: torch.dtype, bias: bool) -> None:
    if not can_pack(dtype):  # (bf16 on a CPU without AVX-512: pack_linears leaves it to F.linear, below)
        with pytest.raises(RuntimeError):
            PackedLinear(torch.ones(4, 4, dtype=dtype), None)(torch.ones(1, 4, dtype=dtype))
        return
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype) if bias else None
    x = torch.randn(3, 5, 32, generator=g).to(dtype)  # any leading shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(PackedLinear(weight, b)(x), F.linear(x, weight, b), atol=tol, rtol=tol)


def test_a_packed_model_gives_the_same_tokens_and_keeps_its_tied_embedding() -> None:
    model = tiny_qwen3("cpu")
    model.config = dataclasses.replace(model.config, tie_word_embeddings=True)
    model.tie_weights()
    packed = copy.deepcopy(model)
    assert pack_linears(packed) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    assert isinstance(packed.lm_head, PackedLinear) and packed.model.embed_tokens is not None
    torch.testing.assert_close(packed.model.embed_tokens.weight, model.model.embed_tokens.weight)
    with torch.inference_mode():
        (ours, ours_tokens), (theirs, theirs_tokens) = greedy(packed, steps=4), greedy(model, steps=4)
    assert ours_tokens == theirs_tokens
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert pack_linears(packed) == 0  # nothing left to pack
    assert pack_linears(tiny_qwen3("cpu").to(torch.float16)) == 0  # fp16: left to torch


def test_bf16_linears_are_packed_only_where_onednn_can_and_compute_alike_either_way() -> None:
    model = tiny_qwen3("cpu").to(torch.bfloat16)
    packed = copy.deepcopy(model)
    assert pack_linears(packed) == (2 * 4 + 1 if can_pack(torch.bfloat16) else 0)
    with torch.inference_mode():
        (_, ours), (_, theirs) = greedy(packed, steps=4), greedy(model, steps=4)
    assert ours == theirs
