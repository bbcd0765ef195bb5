"""Prefill attention in bf16 on the CPU as matmuls over chunks of queries, not torch's SDPA.

torch's CPU SDPA (its flash kernel) gains nothing from bf16: a 2,000-token causal prompt of 12 heads of 64
takes it ~96 ms per layer in bf16 as in fp32 on this project's CPU (avx512_bf16, no AMX), while oneDNN's
bf16 matmuls run at about twice fp32's rate. Here each chunk of ``CHUNK`` queries is two matmuls in the
cache's dtype (its scores against every key it may see, then the softmax's weights against the values),
with the softmax computed in fp32 inside ``torch.softmax``: 56-72 ms for the same layer
(tests/bench/bench_prefill_attention.py). Keys past the chunk's last query are never read, so a causal
prompt costs about half a square, as in a flash kernel; only the chunk's own diagonal block is masked.

A chunk may follow a cached prefix of ``prefix`` keys: its queries see all of them and their own keys
causally, one matmul for both, so no log-sum-exp merge is needed. Query heads share KV heads in groups
(GQA): a group's queries are stacked into one matrix against their KV head's keys, so K/V are never
repeated per query head. In fp32, SDPA stays faster and is kept (``use_chunked``), and in fp16 too: without
native fp16 matmuls (no avx512_fp16 here) the chunks take 3x SDPA's time.
"""

from __future__ import annotations

import torch

CHUNK = 128  # queries per matmul: 64-256 measure alike; smaller chunks waste less of the diagonal block
# A chunk's scores (and their softmax) are [query heads x chunk x keys]: past this many bytes the chunk
# shrinks, down to MIN_CHUNK queries, so that a long context (128k keys x 32 heads) costs tens of MB, not GBs.
SCORES_BYTES = 32 << 20
MIN_CHUNK = 16

_masks: dict[tuple[int, str], torch.Tensor] = {}


def use_chunked(q: torch.Tensor) -> bool:
    """Whether ``chunked_attention`` beats SDPA for ``q``: bf16 queries on the CPU."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


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
    # Head-major and contiguous once per layer, so that every chunk's matmuls read plain strided matrices.
    # Scaled once here, not per chunk of scores.
    grouped = (queries.transpose(0, 1) * scale).contiguous().view(hkv, group, n, d)
    keys_t = keys.transpose(0, 1).contiguous().transpose(1, 2)  # [Hkv, D, keys]
    values_h = values.transpose(0, 1).contiguous()  # [Hkv, keys, D]
    out = torch.empty(hkv, group, n, d, dtype=queries.dtype, device=queries.device)
    chunk = chunk_size(hq, total, queries.element_size())
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        size, seen = end - start, prefix + end
        q = grouped[:, :, start:end].reshape(hkv, group * size, d)
        scores = torch.matmul(q, keys_t[:, :, :seen]).view(hkv, group, size, seen)
        scores[..., prefix + start : seen].masked_fill_(_diagonal_mask(size, queries.device), float("-inf"))
        weights = torch.softmax(scores, dim=-1).view(hkv, group * size, seen)
        out[:, :, start:end] = torch.matmul(weights, values_h[:, :seen]).view(hkv, group, size, d)
    return out.view(hq, n, d).transpose(0, 1)
