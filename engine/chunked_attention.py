"""Prefill attention in bf16 on the CPU as matmuls over chunks of queries, with float32-precise scores.

torch's CPU SDPA (its flash kernel) gains nothing from bf16: a 2,000-token causal prompt of 12 heads of 64
takes it ~95 ms per layer in bf16 as in fp32 on this project's CPU (avx512_bf16, no AMX), while oneDNN's
bf16 matmuls run at about twice fp32's rate. torch offers no CPU matmul with bf16 inputs and a float32
output, and a bf16 output rounds a score of 30 by up to 0.06, which moves a peaked softmax's weights by 6 %
(a path that did that was withdrawn: its rows were 0.24 off the float32 reference where SDPA stays under
0.03).

The scores are therefore computed twice, both times in bf16:

1. ``q @ k^T``, rounded: only its row maxima ``m`` are kept (within 0.4 % of the true ones).
2. ``[q, -m] @ [k, 1]^T`` = ``q @ k^T - m``: the shift happens inside the matmul's float32 accumulation
   (the products of bf16 values are exact in float32), so only the shifted score is rounded, and its error
   is relative to its distance from the row's maximum. The scores that carry the softmax's weight are the
   ones near that maximum: they come out as precise as float32 scores would, and a far one (30 below the
   maximum, weight e^-30) is rounded by as much as before, to no effect.

The softmax (float32 inside ``torch.softmax``) then weighs the values in a third bf16 matmul. Measured on
a 2,000-token prompt, 12 heads of 64, one thread: 56-73 ms a layer against SDPA's 93-100 ms
(``tests/bench/bench_prefill_attention.py``), within 0.025 of the float32 reference on peaked attention
(logits of standard deviation 9), where bf16 SDPA stays within 0.016. The rest of that gap is the weights'
own rounding to bf16 before the last matmul, which GPU flash kernels do too.

Keys past a chunk's last query are never read, so a causal prompt costs about half a square, as in a flash
kernel; only the chunk's own diagonal block is masked. A chunk may follow a cached prefix: its queries see
all of it and their own keys causally, one matmul for both, so no log-sum-exp merge is needed. Query heads
share KV heads in groups (GQA): a group's queries are stacked into one matrix against their KV head's keys,
so K/V are never repeated per query head. fp32 keeps SDPA (faster there), and so does fp16 (no native fp16
matmuls on this CPU: three times SDPA's time), and so do bf16 sequences of fewer than ``MIN_QUERIES`` new
tokens: three matmuls and their layouts cost more than one SDPA call there (1.35x SDPA's time at 128
tokens, about even at 512-768, 0.82x at 1,024 with 4 heads of 64).
"""

from __future__ import annotations

import torch

CHUNK = 128  # queries per matmul: 64-256 measure alike; smaller chunks waste less of the diagonal block
# A chunk's scores (and their softmax) are [query heads x chunk x keys]: past this many bytes the chunk
# shrinks, down to MIN_CHUNK queries, so that a long context (128k keys x 32 heads) costs tens of MB, not GBs.
SCORES_BYTES = 32 << 20
MIN_CHUNK = 16
MIN_QUERIES = 1024  # new tokens of a sequence below which SDPA stays faster

_masks: dict[tuple[int, str], torch.Tensor] = {}


def use_chunked(q: torch.Tensor, queries: int) -> bool:
    """Whether ``chunked_attention`` beats SDPA for a sequence of ``queries`` new tokens of ``q``: bf16 on
    the CPU, ``MIN_QUERIES`` of them at least."""
    return queries >= MIN_QUERIES and q.dtype == torch.bfloat16 and q.device.type == "cpu"


def chunk_size(query_heads: int, keys: int, element_bytes: int) -> int:
    """Queries per chunk: ``CHUNK``, fewer when their scores against ``keys`` keys would pass
    ``SCORES_BYTES``, never fewer than ``MIN_CHUNK``."""
    fits = SCORES_BYTES // max(1, query_heads * keys * element_bytes)
    return max(MIN_CHUNK, min(CHUNK, fits))


def _diagonal_mask(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool, True above the diagonal: the keys of a chunk a query must not see (cached per size)."""
    key = (n, str(device))
    mask = _masks.get(key)
    if mask is None:
        mask = _masks[key] = torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)
    return mask


def chunked_attention(
    queries: torch.Tensor,  # [n, Hq, D]: a sequence's new queries, in the step's layout
    keys: torch.Tensor,  # [prefix + n, Hkv, D]: its cached prefix's keys, then its new ones
    values: torch.Tensor,  # [prefix + n, Hkv, D]
    scale: float,
) -> torch.Tensor:  # [n, Hq, D]
    """Causal attention of ``n`` new queries over ``prefix`` earlier keys and their own, chunk by chunk."""
    n, hq, d = queries.shape
    total, hkv, _ = keys.shape
    group = hq // hkv
    prefix = total - n
    # Head-major once per layer. Scaled once here, not per chunk of scores. The keys get a column of ones
    # (the shift's partner) and are laid out [Hkv, D + 1, keys] row-major: a chunk's first ``seen`` keys are
    # then a plain strided matrix that the matmul reads in place (a slice of the transposed [keys, D]
    # layout made every matmul copy it first: a third of the time).
    grouped = (queries.transpose(0, 1) * scale).contiguous().view(hkv, group, n, d)
    ones = torch.ones(hkv, total, 1, dtype=keys.dtype, device=keys.device)
    shifted_keys = torch.cat((keys.transpose(0, 1), ones), -1).transpose(1, 2).contiguous()  # [Hkv, D+1, n]
    keys_t = shifted_keys[:, :d]
    values_h = values.transpose(0, 1).contiguous()  # [Hkv, keys, D]
    out = torch.empty(hkv, group, n, d, dtype=queries.dtype, device=queries.device)
    chunk = chunk_size(hq, total, queries.element_size())
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        size, seen = end - start, prefix + end
        mask = _diagonal_mask(size, queries.device)
        q = grouped[:, :, start:end].reshape(hkv, group * size, d)
        rough = torch.matmul(q, keys_t[:, :, :seen]).view(hkv, group, size, seen)
        rough[..., prefix + start : seen].masked_fill_(mask, float("-inf"))
        shift = rough.amax(-1).view(hkv, group * size, 1)  # (finite: every query sees its own key)
        scores = torch.matmul(torch.cat((q, shift.neg_()), -1), shifted_keys[:, :, :seen])
        scores = scores.view(hkv, group, size, seen)
        scores[..., prefix + start : seen].masked_fill_(mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1).view(hkv, group * size, seen)
        out[:, :, start:end] = torch.matmul(weights, values_h[:, :seen]).view(hkv, group, size, d)
    return out.view(hq, n, d).transpose(0, 1)
