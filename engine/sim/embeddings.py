"""The SIMULATED engine's ``POST /v1/embeddings``: the request, its validation and the answer's shape are
kvgate's engine's (``engine.embeddings_api``, vLLM's), the vectors are not a model's. Each input's is a
deterministic pseudo-embedding of ``EMBEDDING_DIM`` floats drawn from a generator seeded with the xxh3-64
of its token ids (the same input, the same vector, on every simulator), then L2-normalised as the real one.

Its cost is a prefill with no decode: in the per-request mode a slot, held for the inputs' tokens x
``prefill_s_per_token``; in the batching mode each input is a request of one output token (its prefill) in
the step loop. Nothing is looked up in, or stored into, the prefix cache.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np
import xxhash
from aiohttp import web

from engine.embeddings_api import EmbeddingRequest, embeddings_body, parse_embedding_request
from engine.openai_api import new_request_id
from engine.openai_errors import OpenAIError, json_response, read_body

if TYPE_CHECKING:
    from engine.sim.server import SimEngine

EMBEDDING_DIM = 64
REQUEST_ID_HEADER = "x-request-id"


def pseudo_embedding(token_ids: np.ndarray) -> np.ndarray:
    """A deterministic float32 [EMBEDDING_DIM] vector of ``token_ids``, not normalised (the answer is)."""
    seed = xxhash.xxh3_64_intdigest(np.ascontiguousarray(token_ids, dtype=np.uint32).tobytes())
    return np.random.default_rng(seed).standard_normal(EMBEDDING_DIM).astype(np.float32)


async def handle_embeddings(sim: SimEngine, request: web.Request) -> web.Response:
    request_id = request.headers.get(REQUEST_ID_HEADER) or new_request_id()
    headers = {REQUEST_ID_HEADER: request_id}
    cfg = sim.config
    try:
        req = parse_embedding_request(
            await read_body(request),
            served_model=cfg.model,
            tokenizer=sim.tokenizer,
            request_id=request_id,
            max_model_len=cfg.max_model_len,
        )
        await _cost(sim, req)
    except OpenAIError as exc:
        return exc.to_response(headers)
    sim.counters.embedded(req.prompt_tokens)
    return json_response(embeddings_body(req, [pseudo_embedding(ids) for ids in req.inputs]), headers=headers)


async def _cost(sim: SimEngine, req: EmbeddingRequest) -> None:
    """Wait what the prefill of the inputs costs in the simulator's mode."""
    batching = sim.batching
    if batching is None:
        tokens = req.prompt_tokens
        await sim.slots.admit(tokens)
        try:
            with sim.busy("prefill"):
                await asyncio.sleep(tokens * sim.config.prefill_s_per_token)
        finally:
            sim.slots.release()
        return
    tickets = []
    try:
        for ids in req.inputs:
            try:
                tickets.append(batching.submit(int(ids.shape[0]), 0, 1))
            except ValueError as exc:
                raise OpenAIError(f"the request does not fit this engine: {exc}", param="input") from None
        for ticket in tickets:
            await ticket.wait_finished()
    finally:
        for ticket in tickets:
            if not ticket.finished:
                batching.abort(ticket)  # a client that left: no more steps for it
