"""A check at start that a vLLM engine turns text into the token ids this gateway does.

The gateway hashes the ids it computes; the engine caches the ids it computes. A different tokenizer revision,
a ``--chat-template`` override or a template that adds a BOS token makes the two disagree, and then no
predicted cache hit ever happens there and a prompt sent as ids would be a different prompt. vLLM's
``POST /tokenize`` shows its ids for a chat (rendered with its template, as ``/v1/chat/completions`` does:
``add_special_tokens`` false) and for a plain prompt (as ``/v1/completions`` does: ``add_special_tokens``
true); the gateway's are ``cache.chat_template.render_messages`` then ``Tokenizer.encode``, as
``gateway.prepare`` does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import aiohttp

from cache.chat_dialect import ChatContentError
from cache.chat_template import render_messages
from cache.tokens import Tokenizer
from gateway.http.relay import cut_message
from region_map.config import EngineKind
from region_map.fleet import EngineState

log = logging.getLogger("kvgate.engine_probe")

# Short, but with what tokenizers disagree on: a system turn, punctuation, accents, non-Latin script.
SAMPLE_CHAT: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
    {"role": "user", "content": "What does a KV cache hold? Réponds aussi en français — 10 mots, 東京."},
)
SAMPLE_PROMPT = "The KV cache holds keys and values: café, naïve, 東京 — 42!"

Renderer = Callable[[Tokenizer, Sequence[Mapping[str, Any]]], str]


class _Refused(Exception):
    """The engine answered /tokenize with an error about the request itself (a finding, not an outage)."""


async def check_tokenizer(
    engine: EngineState,
    session: aiohttp.ClientSession,
    tokenizer: Tokenizer,
    *,
    render: Renderer = render_messages,
    timeout_s: float = 5.0,
) -> str | None:
    """Compare the engine's ids for ``SAMPLE_CHAT`` and ``SAMPLE_PROMPT`` with this gateway's.

    Returns None when both agree, else one line naming what differs (the first differing position and both
    tokens there) for the caller to log as an ERROR. Sets ``engine.tokenizer_agrees``: True when both agree,
    False when either differs; it stays as it was when nothing could be compared: an engine without
    ``/tokenize`` (404, logged at DEBUG) or one that cannot be reached (logged at WARNING), which return None.
    ``render`` turns messages into prompt text as the gateway does (``cache.chat_template.render_messages``).
    """
    model = engine.model
    base: dict[str, Any] = {"model": model} if model else {}
    chat_body = {
        **base,
        "messages": list(SAMPLE_CHAT),
        "add_generation_prompt": True,
        "add_special_tokens": False,
    }
    prompt_body = {**base, "prompt": SAMPLE_PROMPT, "add_special_tokens": True}
    try:
        theirs_chat = await _tokenize(engine, session, chat_body, timeout_s)
        if theirs_chat is None:
            return None
        theirs_prompt = await _tokenize(engine, session, prompt_body, timeout_s)
    except _Refused as exc:
        engine.tokenizer_agrees = False
        return f"engine {engine.id} ({model}) refused to tokenize a sample: {exc}"
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        why = str(exc) or type(exc).__name__
        log.warning("engine %s: tokenizer not checked, /tokenize failed: %s", engine.id, why)
        return None
    try:
        ours_chat = [int(t) for t in tokenizer.encode(render(tokenizer, SAMPLE_CHAT))]
    except ChatContentError as exc:
        engine.tokenizer_agrees = False
        return f"this gateway's chat template fails on a sample chat that engine {engine.id} renders: {exc}"
    ours_prompt = [int(t) for t in tokenizer.with_special_tokens(tokenizer.encode(SAMPLE_PROMPT))]
    findings = []
    chat = _first_difference(theirs_chat, ours_chat, tokenizer)
    if chat is not None:
        findings.append(f"a chat (its template and tokenizer) {chat}")
    prompt = None if theirs_prompt is None else _first_difference(theirs_prompt, ours_prompt, tokenizer)
    if prompt is not None:
        findings.append(f"a plain prompt {prompt}")
    engine.tokenizer_agrees = not findings
    if not findings:
        log.debug("engine %s tokenizes as this gateway does", engine.id)
        return None
    return f"engine {engine.id} ({model}) tokenizes differently from this gateway: " + "; ".join(findings)


async def _tokenize(
    engine: EngineState, session: aiohttp.ClientSession, body: dict[str, Any], timeout_s: float
) -> list[int] | None:
    """The engine's ids for ``body``; None when it has no ``/tokenize``. Raises _Refused when it refuses
    the request, aiohttp/timeout errors or ValueError when it cannot be asked or answers nonsense."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(f"{engine.url}/tokenize", json=body, timeout=timeout) as resp:
        raw = await resp.read()
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    if resp.status in (404, 405) and error is None:
        # A server without the route (FastAPI says {"detail": "Not Found"}). vLLM's own errors, an unknown
        # model's 404 among them, carry an "error" object.
        log.debug("engine %s has no /tokenize (%d): tokenizer not checked", engine.id, resp.status)
        return None
    if resp.status != 200:
        message = error.get("message") if isinstance(error, dict) else None
        # Cut as every engine error the gateway relays or logs is: the caller logs this line.
        message = cut_message(str(message)) if message else raw[:300].decode(errors="replace")
        said = f"/tokenize answered {resp.status}: {message}"
        raise _Refused(said) if 400 <= resp.status < 500 else ValueError(said)
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ValueError(
            f"/tokenize answered without a list of token ids: {raw[:300].decode(errors='replace')}"
        )
    return tokens


def _first_difference(theirs: Sequence[int], ours: Sequence[int], tokenizer: Tokenizer) -> str | None:
    """None when equal, else where the two id sequences first part and what each holds there."""
    if list(theirs) == list(ours):
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), min(len(theirs), len(ours))
    )
    return (
        f"first differs at token {at} (engine {len(theirs)} ids, gateway {len(ours)}): "
        f"engine {_token(theirs, at, tokenizer)}, gateway {_token(ours, at, tokenizer)}"
    )


def _token(ids: Sequence[int], at: int, tokenizer: Tokenizer) -> str:
    if at >= len(ids):
        return "ends there"
    try:
        # The gateway's tokenizer names the engine's id too: with another vocabulary the text may be wrong,
        # and the ids still say what differs.
        text = tokenizer.decode([ids[at]])
    except Exception:  # a tokenizer's decode of an id outside its vocabulary raises its own errors
        text = ""
    return f"{ids[at]} {text!r}" if text else str(ids[at])


async def check_tokenizers_forever(
    fleet: Iterable[EngineState], session: aiohttp.ClientSession, tokenizer: Tokenizer, interval_s: float
) -> None:
    """Check each vLLM engine once per healthy spell: when it first answers, and again after it was down
    (a restarted engine may run another tokenizer or template). A disagreement is logged as an ERROR."""
    checked: set[str] = set()
    while True:
        for engine in fleet:
            if not engine.healthy:
                checked.discard(engine.id)
                continue
            if engine.kind is not EngineKind.VLLM or engine.id in checked or not engine.model:
                continue
            checked.add(engine.id)
            problem = await check_tokenizer(engine, session, tokenizer)
            if problem is not None:
                log.error(
                    "%s; prompts go to it as text, and its predicted cache hits are unreliable", problem
                )
        await asyncio.sleep(interval_s)
