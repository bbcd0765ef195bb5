"""The tensor math of sampling for a whole batch at once, on whatever device the logits are on.

Randomness comes in as uniforms (one row of them per sequence, drawn by engine.sampler from that sequence's
own generator), so no row's draw depends on what else is in the batch.

Drawing without a full cumulative sum: the vocabulary is cut into blocks of ``BLOCK`` tokens; a uniform
picks a block by the blocks' cumulative mass, then a token inside that block (inverse CDF in id order).

Top-p without sorting the vocabulary: a drawn token is kept only if the tokens strictly likelier than it
hold less than top_p of the mass, which is exactly membership of the top-p set; a rejected draw is
retried with the row's next uniform. The kept draws follow the top-p distribution exactly (rejection
sampling, the filtered distribution being the proposal): each try keeps at least top_p of the proposals,
so after ``CANDIDATES`` tries only a row with a small top_p is likely to be left, and it falls back to one
sort (with a uniform of its own: the rejected ones are no longer uniform). Ties at the top-p boundary all
stay in, where a sort keeps the ones it happens to put first.

Masks are float arithmetic rather than boolean tensors: on CPU a comparison plus ``masked_fill`` costs
several times a float pass. And on CPU a fresh [batch, vocab] tensor costs page faults worth more than
the pass that fills it, so the big temporaries live in a :class:`Scratch` kept from step to step.
"""

from __future__ import annotations

import torch

BLOCK = 256  # tokens per block of the two-level draw
CANDIDATES = 8  # top-p draws tried per row before the sort fallback
UNIFORMS_PER_ROW = CANDIDATES + 1  # the last one is the fallback's
# Columns of the per-row parameter table that travels to the device in one copy, uniforms after these.
TEMPERATURE, TOP_K, TOP_P, MIN_P, FIRST_UNIFORM = 0, 1, 2, 3, 4


class Scratch:
    """Float32 buffers reused from step to step, by name, each as large as the largest batch seen: on CPU
    only (CUDA's caching allocator already reuses memory, and would otherwise hold it twice)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """A [rows, vocab] contiguous tensor, its contents undefined; valid until ``name`` is asked again."""
        if device.type != "cpu":
            return torch.empty(rows, vocab, device=device)
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != vocab or buf.device != device:
            buf = self._buffers[name] = torch.empty(rows, vocab, device=device)
        return buf[:rows]


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, the same index (the first maximum; NaN counts as the maximum, as
    there). On the CPU torch's argmax is a scalar loop (0.7 ms for 64 rows of a 16k vocabulary, float32, one
    thread) while its max-reduction is vectorized (0.06 ms): so the maximum of each ``BLOCK`` of a row
    first, then the argmax over those maxima (the first block holding the row's maximum) and within that one
    block. Elsewhere torch's argmax as it is."""
    rows, vocab = x.shape
    n = vocab // BLOCK
    if x.device.type != "cpu" or n < 4 or rows * vocab < 1 << 16 or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    body = x[:, : n * BLOCK].view(rows, n, BLOCK)
    block = body.amax(dim=-1).argmax(dim=-1)  # [rows]
    ids = block * BLOCK + body[torch.arange(rows), block].argmax(dim=-1)
    if n * BLOCK == vocab:
        return ids
    # The ids past the last whole block: theirs wins only over a strictly smaller maximum (or a NaN).
    tail = x[:, n * BLOCK :]
    tail_ids = tail.argmax(dim=-1)
    best, tail_best = x.gather(1, ids[:, None])[:, 0], tail.gather(1, tail_ids[:, None])[:, 0]
    takes = (tail_best > best) | (tail_best.isnan() & ~best.isnan())
    return torch.where(takes, tail_ids + n * BLOCK, ids)


def zero_below(p: torch.Tensor, floor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p`` [S, V] with every entry below its row's ``floor`` [S, 1] set to 0 (in place; ``out``, like
    ``p``, as scratch if given)."""
    diff = p - floor if out is None else torch.sub(p, floor, out=out)
    return p.mul_(diff.sign_().add_(1.0).clamp_(max=1.0))  # x 0 below the floor, x 1 at or above it


def kth_largest(p: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """[S, 1]: each row's ``k``-th largest entry (k [S] as floats, 0 = off gives 0); ``k_max`` bounds k."""
    k_max = min(k_max, p.shape[-1])
    top = torch.topk(p, k_max, dim=-1).values
    pick = (k.long() - 1).clamp(0, k_max - 1).unsqueeze(-1)
    return torch.where(k.unsqueeze(-1) > 0, top.gather(-1, pick), 0.0)


def block_sums(p: torch.Tensor) -> torch.Tensor:
    """[S, ceil(V / BLOCK)]: the mass of each block of ``BLOCK`` consecutive token ids (the last may be
    shorter)."""
    rows, vocab = p.shape
    full = vocab // BLOCK
    sums = p[:, : full * BLOCK].view(rows, full, BLOCK).sum(dim=-1)
    if vocab % BLOCK:
        sums = torch.cat([sums, p[:, full * BLOCK :].sum(dim=-1, keepdim=True)], dim=-1)
    return sums


def _below(total: torch.Tensor) -> torch.Tensor:
    """The largest float below ``total``: a target there still falls inside the last entry with mass."""
    return torch.nextafter(total, torch.zeros_like(total))


def inverse_cdf(
    p: torch.Tensor, sums: torch.Tensor, u: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Token ids [S', R] drawn by uniforms ``u`` [S', R] from the weights ``p`` [S, V] (contiguous, not
    necessarily normalised) whose ``block_sums`` are ``sums``, for the rows ``rows`` [S'] (None: all);
    a token of weight 0 is never drawn."""
    vocab = p.shape[-1]
    if rows is not None:
        sums = sums.index_select(0, rows)
    cum = sums.cumsum(dim=-1)
    total = cum[:, -1:]
    # u may round up to 1 in float32: stay strictly below the total.
    target = torch.minimum(u * total, _below(total))
    block = torch.searchsorted(cum, target.contiguous(), right=True)  # [S', R]
    before = torch.where(block > 0, cum.gather(-1, (block - 1).clamp(min=0)), 0.0)
    cols = block.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=p.device)  # [S', R, BLOCK]
    ragged = vocab % BLOCK != 0  # the last block is short: its missing columns weigh nothing
    flat = cols.clamp(max=vocab - 1) if ragged else cols
    if rows is not None:  # read the rows in place rather than copying them out of p
        flat = flat + (rows * vocab).view(-1, 1, 1)
    inside = p.view(-1)[flat] if rows is not None else p.gather(-1, flat.flatten(1)).view(cols.shape)
    if ragged:
        inside = inside.masked_fill(cols >= vocab, 0.0)
    inside = inside.cumsum(dim=-1)
    # The block's own running sum may end an ulp short of what block_sums said: stay inside it.
    rest = torch.minimum(target - before, _below(inside[..., -1])).unsqueeze(-1)
    pos = torch.searchsorted(inside, rest.contiguous(), right=True).squeeze(-1)
    return block * BLOCK + pos


def mass_above(p: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[S, 1]: the weight of the entries strictly heavier than ``b`` [S, 1] (> 0), in each row of ``p``
    [S, V], using ``out`` (like ``p``) as scratch if given. Scaled so that every row's bar is 1, one
    ``threshold`` pass zeroes the rest."""
    scaled = p / b if out is None else torch.div(p, b, out=out)
    kept = torch.nn.functional.threshold(scaled, 1.0, 0.0, inplace=True)
    return kept.sum(dim=-1, keepdim=True).mul_(b)


def top_p_sorted(sorted_p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Weights sorted in descending order with those outside the top-p set zeroed: a token stays while
    the tokens before it hold less than top_p of the mass (so the likeliest always stays)."""
    cum = sorted_p.cumsum(dim=-1)
    return sorted_p.masked_fill(cum - sorted_p >= top_p * cum[:, -1:], 0.0)


def top_p_exact(p: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids [S] drawn by ``u`` [S, 1] from the top-p set of ``p`` [S, V] (top_p [S, 1]), by one sort."""
    sorted_p, order = torch.sort(p, dim=-1, descending=True)
    kept = top_p_sorted(sorted_p, top_p)
    cum = kept.cumsum(dim=-1)
    target = torch.minimum(u * cum[:, -1:], _below(cum[:, -1:]))
    return order.gather(-1, torch.searchsorted(cum, target.contiguous(), right=True))[:, 0]


def filtered_weights(
    logits: torch.Tensor,
    table: torch.Tensor,
    *,
    scale: bool,
    k_max: int,
    use_min_p: bool,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """The rows' probabilities up to a factor, the likeliest token weighing 1: ``logits`` [S, V] turned
    into them in place (no new [S, V] tensor to allocate and fault in), then min_p and top_k applied (as
    vLLM orders them; the two commute) by zeroing. Parameters come from the rows' ``table``; ``scale``:
    some row's temperature is not 1; ``k_max``: the largest top_k in use, 0 for none."""
    w = logits.sub_(logits.amax(dim=-1, keepdim=True))
    if scale:
        w.div_(table[:, TEMPERATURE : TEMPERATURE + 1])
    w.exp_()
    floor = table[:, MIN_P : MIN_P + 1] if use_min_p else None  # a fraction of the likeliest's weight, 1
    if k_max:
        kth = kth_largest(w, table[:, TOP_K], k_max)
        floor = kth if floor is None else torch.maximum(floor, kth)
    if floor is None:
        return w
    rows, vocab = w.shape
    return zero_below(w, floor, None if scratch is None else scratch.get("scaled", rows, vocab, w.device))


def draw(
    logits: torch.Tensor,
    table: torch.Tensor,
    *,
    scale: bool,
    k_max: int,
    use_min_p: bool,
    top_p_rows: torch.Tensor | None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Token ids [S] (on the logits' device) for rows that sample (temperature > 0), one row of ``table``
    each: temperature, top_k (0: off), top_p, min_p, then ``UNIFORMS_PER_ROW`` uniforms. The flags say
    which filters some row uses (the others cost nothing); ``top_p_rows``: the rows with top_p < 1 (a
    tensor of row indices, or None for none). Consumes ``logits`` (contiguous): they become weights."""
    p = filtered_weights(logits, table, scale=scale, k_max=k_max, use_min_p=use_min_p, scratch=scratch)
    sums = block_sums(p)
    uniforms = table[:, FIRST_UNIFORM:]
    tokens = inverse_cdf(p, sums, uniforms[:, :1])[:, 0]
    if top_p_rows is not None:
        _top_p(p, sums, tokens, top_p_rows, table[:, TOP_P : TOP_P + 1], uniforms, scratch)
    return tokens


def _top_p(
    p: torch.Tensor,
    sums: torch.Tensor,
    tokens: torch.Tensor,
    rows: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    scratch: Scratch | None,
) -> None:
    """Replace each of ``tokens[rows]`` (drawn with the rows' first uniform) outside its row's top-p set
    by the first of its next draws inside it, by rejection (see the module's docstring)."""
    limit = top_p * sums.sum(dim=-1, keepdim=True)  # the mass above a kept token stays under this
    everyone = rows.numel() == p.shape[0]  # then the first try needs no copy of the rows
    sub = p if everyone else p.index_select(0, rows)
    cand = tokens if everyone else tokens.index_select(0, rows)
    out = None if scratch is None else scratch.get("scaled", sub.shape[0], sub.shape[1], sub.device)
    kept = (mass_above(sub, sub.gather(-1, cand.unsqueeze(-1)), out) < limit.index_select(0, rows))[:, 0]
    rows = rows[~kept]  # reads the mask back: the other tries concern the rejected rows only
    # The second try keeps all but a few rows; those try all their other candidates at once, in chunks
    # of rows no bigger ([rows, candidates, V]) than the batch: a small top_p costs time, not memory.
    for first, end in ((1, 2), (2, CANDIDATES)):
        chunk = max(1, p.shape[0] // (end - first))
        left = [
            _try_candidates(p, sums, tokens, rows[at : at + chunk], first, end, limit, uniforms, scratch)
            for at in range(0, rows.numel(), chunk)
        ]
        rows = torch.cat(left) if left else rows
    if rows.numel():
        u = uniforms[rows, CANDIDATES:]
        tokens.index_copy_(0, rows, top_p_exact(p.index_select(0, rows), top_p.index_select(0, rows), u))


def _try_candidates(
    p: torch.Tensor,
    sums: torch.Tensor,
    tokens: torch.Tensor,
    rows: torch.Tensor,
    first: int,
    end: int,
    limit: torch.Tensor,
    uniforms: torch.Tensor,
    scratch: Scratch | None,
) -> torch.Tensor:
    """For ``rows`` without a token in their top-p set yet: the first of their candidates ``first`` to
    ``end`` (drawn with those uniforms) that is in it goes to ``tokens``; returns the rows that found none."""
    more = inverse_cdf(p, sums, uniforms[rows, first:end], rows)
    sub = p.index_select(0, rows)
    b = sub.gather(-1, more).unsqueeze(-1)  # [R, C, 1]
    shape = (rows.numel(), end - first, p.shape[1])
    out = (
        None
        if scratch is None
        else scratch.get("scaled", shape[0] * shape[1], shape[2], p.device).view(shape)
    )
    scaled = sub.unsqueeze(1) / b if out is None else torch.div(sub.unsqueeze(1), b, out=out)
    above = torch.nn.functional.threshold(scaled, 1.0, 0.0, inplace=True).sum(dim=-1)
    ok = above * b.squeeze(-1) < limit.index_select(0, rows)  # [R, C]
    found = ok.any(dim=-1)
    # The first candidate inside: the largest of ok x (C - position).
    pick = (ok * torch.arange(end - first, 0, -1, device=p.device)).argmax(dim=-1, keepdim=True)
    tokens.index_copy_(0, rows, torch.where(found, more.gather(-1, pick)[:, 0], tokens.index_select(0, rows)))
    return rows[~found]  # reads the mask back


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """[L, 1 + 2k]: each row's chosen token's logprob, then the k largest logprobs and their token ids (as
    floats: exact below 2**24), packed so that they reach the host in one copy."""
    parts = [logprobs.gather(-1, chosen.unsqueeze(-1))]
    if k:
        top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        parts += [top.values, top.indices.to(logprobs.dtype)]
    return torch.cat(parts, dim=-1)
