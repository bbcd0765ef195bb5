"""Next-token sampling for the whole batch at once, on the device that holds the logits.

One ``Sampler.sample`` call per step: logit_bias, the min_tokens ban and the penalties change the logits
(engine.sampling_penalties), greedy rows take the argmax, the others draw under temperature, min_p, top_k
and top_p (engine.sampling_ops). Only the token ids reach the host, plus the logprobs of the rows that asked
for them: one packed copy each.

Logprobs are vLLM's default "raw" mode: log_softmax of the logits exactly as the model produced them,
before logit_bias, penalties and temperature (so a biased or banned token keeps its model logprob).

Randomness: every sequence has a ``random.Random`` of its own (seeded with the request's seed, else from
the OS) and takes ``UNIFORMS_PER_ROW`` uniforms from it per sampled token, whatever else shares the batch:
a seeded request gives the same tokens alone or batched. The stream is not torch.multinomial's, so the
tokens differ from the earlier host sampler's for the same seed; the distribution is the same.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.engine_types import TokenLogprob
from engine.sampling_ops import UNIFORMS_PER_ROW, Scratch, draw, row_argmax, top_logprobs
from engine.sampling_penalties import PenaltyPool, add_bias, ban
from engine.sequence import SamplingParams

MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's limit)


def make_rng(seed: int | None) -> random.Random:
    """A sequence's own generator: seeded, the same request draws the same uniforms."""
    return random.Random() if seed is None else random.Random(seed % 2**64)


class SamplingSeq(Protocol):
    """What the sampler reads of a sequence (``engine.sequence.Sequence``, or a worker's copy of it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def token_ids(self) -> list[int]: ...  # starts with the prompt (read once, for penalties)
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the request did not ask for them


@dataclass(slots=True)
class _SeqState:
    rng: random.Random
    slot: int | None = None  # its row in the penalty pool, for penalised sequences


class Sampler:
    """Samples the next token of every sequence in a batch; keeps each sequence's generator and token
    counts until ``forget``."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._states: dict[str, _SeqState] = {}
        self._pool: PenaltyPool | None = None
        self._scratch = Scratch()

    @torch.inference_mode()  # the pool's tensors were made in inference mode: only there can they change
    def forget(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and state.slot is not None and self._pool is not None:
            self._pool.release(state.slot)

    def _state(self, seq: SamplingSeq, device: torch.device) -> _SeqState:
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = _SeqState(make_rng(seq.params.seed))
            if seq.params.penalized:
                if self._pool is None:
                    self._pool = PenaltyPool(self.vocab_size, device)
                state.slot = self._pool.take(seq.token_ids[: seq.num_prompt_tokens])
        return state

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, seqs: Seq[SamplingSeq], eos_token_ids: Iterable[int] = ()
    ) -> SamplerOutput:
        """One token per row of ``logits`` [N, vocab] (float32, any device; changed in place) for the N
        sequences ``seqs``, in order. ``eos_token_ids``: what min_tokens holds off besides stop_token_ids."""
        device = logits.device
        params = [s.params for s in seqs]
        states = [self._state(s, device) for s in seqs]
        # Raw logprobs: before anything below changes the logits.
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        self._process(logits, seqs, states, tuple(eos_token_ids))
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy) == len(params):
            ids = row_argmax(logits)
        else:
            ids = torch.empty(len(params), dtype=torch.long, device=device)
            if greedy:
                index = torch.tensor(greedy, device=device)
                ids.index_copy_(0, index, row_argmax(logits.index_select(0, index)))
            self._draw(logits, ids, [i for i, p in enumerate(params) if not p.greedy], params, states)
        pool = self._pool
        counted = [(i, s.slot) for i, s in enumerate(states) if s.slot is not None]
        if counted and pool is not None:
            rows, slots = zip(*counted, strict=True)
            pool.record(torch.tensor(slots, device=device), ids[list(rows)])
        token_ids: list[int] = ids.tolist()  # the step's one wait for the device
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        if raw is not None:
            k = max(params[i].logprobs or 0 for i in lp_rows)
            packed: list[list[float]] = top_logprobs(raw, ids[lp_rows], k).tolist()
            for i, row in zip(lp_rows, packed, strict=True):
                own = params[i].logprobs or 0
                top = tuple(
                    (int(t), v) for v, t in zip(row[1 : 1 + own], row[1 + k : 1 + k + own], strict=True)
                )
                logprobs[i] = TokenLogprob(token_ids[i], row[0], top)
        return SamplerOutput(token_ids, logprobs)

    def _process(
        self, logits: torch.Tensor, seqs: Seq[SamplingSeq], states: list[_SeqState], eos: tuple[int, ...]
    ) -> None:
        """logit_bias, then the min_tokens ban, then the penalties (vLLM's order), on the rows using them."""
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        biases: list[float] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            for token, value in p.logit_bias:
                bias_rows.append(i)
                bias_ids.append(token)
                biases.append(value)
            if seq.num_output_tokens < p.min_tokens:
                held = p.stop_token_ids if p.ignore_eos else (*eos, *p.stop_token_ids)
                ban_rows.extend([i] * len(held))
                ban_ids.extend(held)
        if bias_rows:
            add_bias(logits, bias_rows, bias_ids, biases)
        if ban_rows:
            ban(logits, ban_rows, ban_ids)
        penalised = [i for i, s in enumerate(states) if s.slot is not None]
        if penalised and self._pool is not None:
            ps = [seqs[i].params for i in penalised]
            table = [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in ps]
            self._pool.apply(
                logits,
                None if len(penalised) == len(seqs) else torch.tensor(penalised, device=logits.device),
                torch.tensor([states[i].slot for i in penalised], device=logits.device),
                torch.tensor(table, dtype=logits.dtype, device=logits.device),
                repetition=any(p.repetition_penalty != 1.0 for p in ps),
                additive=any(p.frequency_penalty or p.presence_penalty for p in ps),
                scratch=self._scratch,
            )

    def _draw(
        self,
        logits: torch.Tensor,
        ids: torch.Tensor,
        rows: list[int],
        params: list[SamplingParams],
        states: list[_SeqState],
    ) -> None:
        """Fill ``ids[rows]`` with draws for the rows that sample."""
        device = logits.device
        vocab = logits.shape[-1]
        ps = [params[i] for i in rows]
        table = []
        for i, p in zip(rows, ps, strict=True):
            rng = states[i].rng
            top_k = p.top_k if 0 < p.top_k < vocab else 0
            table.append(
                [p.temperature, top_k, p.top_p, p.min_p, *[rng.random() for _ in range(UNIFORMS_PER_ROW)]]
            )
        top_p_rows = [j for j, p in enumerate(ps) if p.top_p < 1.0]
        everyone = len(rows) == logits.shape[0]
        index = None if everyone else torch.tensor(rows, device=device)
        sub = logits
        if index is not None:
            sub = torch.index_select(
                logits, 0, index, out=self._scratch.get("sampled", len(rows), vocab, device)
            )
        drawn = draw(
            sub,
            torch.tensor(table, dtype=torch.float32, device=device),
            scale=any(p.temperature != 1.0 for p in ps),
            k_max=max((int(row[1]) for row in table), default=0),
            use_min_p=any(p.min_p > 0.0 for p in ps),
            top_p_rows=None if not top_p_rows else torch.tensor(top_p_rows, device=device),
            scratch=self._scratch,
        )
        if index is None:
            ids.copy_(drawn)
        else:
            ids.index_copy_(0, index, drawn)
