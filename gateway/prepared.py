"""``Prepared``: a client's request validated, tokenized and hashed (gateway.prepare makes it): everything
routing, the engine's body and accounting read of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.request_limits import EMBEDDINGS_PATH, RESPONSES_PATH
from gateway.routing.base import route_key
from region_map.fleet import ChainKey


@dataclass(slots=True)
class Prepared:
    """A validated request, tokenized and hashed: everything routing needs."""

    request_id: str
    tenant: str
    session_id: str | None
    model: str
    path: str  # the engine endpoint it goes to
    body: dict[str, Any]  # the client's body, forwarded with the gateway's additions
    stream: bool
    client_wants_usage: bool
    token_ids: np.ndarray
    chains: dict[ChainKey, list[int]]  # the prompt's block hashes in each routing block size (see chain_keys)
    cache_salt: str  # the tenant's salt (and the client's, if it sent one): engines get it as cache_salt
    home_region: str  # where the client is (see gateway.routing.home)
    shared_tokens: int = 0  # leading tokens of an operator-declared public prefix every tenant shares
    key_id: str = ""
    record_id: str = ""  # the ledger's idempotency key: unique per request, whatever the client sends
    max_tokens: int = (
        16  # per choice, exactly what the engine is told (see gateway.request_limits.output_budget)
    )
    # False: a chat that named no budget, sent without one (the engine writes what its context leaves, as
    # OpenAI's chat does); ``max_tokens`` is then only what admission charges before the answer is known.
    budget_named: bool = True
    choices: int = 1  # n (or best_of): the engine generates up to choices x max_tokens
    tools: bool = False  # it asks for tool calling: only engines configured with tools may take it
    # A Responses API request continuing a stored response: only the engine holding it can answer it.
    previous_response_id: str | None = None
    pinned_engine: str | None = None  # that engine, when the gateway knows where the response went
    # False: ``token_ids`` are the text of a prompt with media the gateway does not render (gateway.media),
    # to be admitted, never sent in place of the client's prompt.
    whole_prompt: bool = True
    ratelimit_headers: dict[str, str] | None = None  # its caller's x-ratelimit-* at admission
    trace: tuple[tuple[str, str], ...] = ()  # the client's trace context, for every engine it goes to

    @property
    def engine_headers(self) -> list[tuple[str, str]]:
        """The headers of every request the gateway sends an engine for it (the prefill half's too)."""
        return [("Content-Type", "application/json"), ("X-Request-Id", self.request_id), *self.trace]

    @property
    def disaggregable(self) -> bool:
        """A Responses API request is not: its prefill engine would store a response of its own, and the P/D
        protocols hand K/V over for completions only. Nor is an embedding, which decodes nothing."""
        return self.path != RESPONSES_PATH and self.path != EMBEDDINGS_PATH

    @property
    def hashes(self) -> list[int]:
        """One chain, the same for every request of a conversation whatever engine takes it (route keys)."""
        return self.chains[min(self.chains)] if self.chains else []

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def route_key(self) -> int:
        """Stable per conversation (see ``gateway.routing.base.route_key``)."""
        hashes = self.hashes
        return route_key(self.tenant, self.session_id, hashes, b"" if hashes else self.token_ids.tobytes())

    @property
    def output_budget(self) -> int:
        """Completion tokens the engine may generate for this request, all choices together."""
        return self.max_tokens * self.choices
