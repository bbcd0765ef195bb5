"""Prefill/decode disaggregation with third-party engines, in the protocols their own routers speak.

- **vLLM** (NixlConnector; as vLLM's toy proxy, vllm-router and llm-d do it): the prompt goes first to the
  prefill engine reduced to one whole token with ``kv_transfer_params.do_remote_decode``; its answer carries
  the ``kv_transfer_params`` (remote block ids, engine id, host, port) that the decode engine needs to pull
  the K/V. The client's request then goes to the decode engine with those parameters, and its answer is
  the client's. The prefill is awaited before the decode is sent: a failure there is a clean failover.
- **SGLang** (as sgl-model-gateway does it): ``bootstrap_host``, ``bootstrap_port`` and a random
  ``bootstrap_room`` are added to the body, and the same body goes to the prefill and the decode engine
  at once; the decode engine's answer is the client's, the prefill engine's is read and dropped. A prefill
  that fails before the decode engine answers fails the attempt (the decode engine would wait for its room
  in vain).
kvgate's own engines need neither: the decode engine pulls from the prefill engine it is told about.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable
from typing import Any

import orjson

from gateway.http.engine_body import prefill_only
from gateway.http.relay import error_fields, read_answer
from gateway.http.upstream import UpstreamPool, split_base_url
from gateway.http.upstream_errors import UpstreamError
from gateway.http.upstream_response import Response

log = logging.getLogger("kvgate.pd")

# What vLLM's proxies send a prefill engine: "compute the prompt, keep its K/V for a remote decode".
VLLM_DO_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class PrefillFailed(Exception):
    """The prefill half of a disaggregated request failed; the decode engine is not to blame."""


async def vllm_prefill(
    pool: UpstreamPool, path: str, body: dict[str, Any], headers: list[tuple[str, str]], timeout_s: float
) -> dict[str, Any]:
    """Run the prefill on a vLLM prefill engine; returns the ``kv_transfer_params`` its answer carries.
    ``headers``: the request's (``Prepared.engine_headers``: its id and trace context, as the decode
    half's)."""
    prefill_body = prefill_only(body)
    prefill_body["kv_transfer_params"] = dict(VLLM_DO_REMOTE_DECODE)
    data = await _prefill_half(pool, path, prefill_body, headers, timeout_s)
    try:
        params = orjson.loads(data).get("kv_transfer_params")
    except (orjson.JSONDecodeError, AttributeError):
        raise PrefillFailed("answered with a body that is not a JSON object") from None
    if not isinstance(params, dict):
        raise PrefillFailed(
            "answered without kv_transfer_params: is it started with --kv-transfer-config "
            "(kv_role kv_producer or kv_both)?"
        )
    return params


async def _prefill_half(
    pool: UpstreamPool, path: str, body: dict[str, Any], headers: list[tuple[str, str]], timeout_s: float
) -> bytes:
    """Send the prefill engine its half and read the answer whole; PrefillFailed unless it is a 200."""
    payload = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    try:
        response = await pool.request("POST", path, payload, headers, header_timeout=timeout_s)
        data = await read_answer(response, timeout_s)
    except UpstreamError as exc:
        raise PrefillFailed(str(exc) or type(exc).__name__) from None
    if response.status != 200:
        _, _, message = error_fields(data, response.status)
        raise PrefillFailed(f"answered {response.status}: {message}")
    return data


def sglang_bootstrap(prefill_url: str, bootstrap_port: int) -> dict[str, Any]:
    """The fields that pair an SGLang prefill and decode engine for one request."""
    host, _, _ = split_base_url(prefill_url)
    return {
        "bootstrap_host": host,
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }


class SglangPrefill:
    """The prefill half of an SGLang request, sent beside the decode half; its answer is read and dropped."""

    def __init__(
        self,
        pool: UpstreamPool,
        path: str,
        body: dict[str, Any],
        headers: list[tuple[str, str]],
        timeout_s: float,
    ) -> None:
        self._task = asyncio.create_task(_prefill_half(pool, path, body, headers, timeout_s))
        self._task.add_done_callback(_log_late_failure)

    async def race(self, decode: Awaitable[Response]) -> Response:
        """The decode engine's answer; PrefillFailed instead when the prefill fails before it comes."""
        decode_task = asyncio.ensure_future(decode)
        try:
            done, _ = await asyncio.wait({decode_task, self._task}, return_when=asyncio.FIRST_COMPLETED)
            if decode_task not in done and self._task.exception() is not None:
                decode_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, UpstreamError):
                    await decode_task
                raise PrefillFailed(str(self._task.exception()))
            return await decode_task
        except asyncio.CancelledError:
            decode_task.cancel()
            self.cancel()
            raise

    def cancel(self) -> None:
        self._task.cancel()


def _log_late_failure(task: asyncio.Task[bytes]) -> None:
    """Retrieve the prefill's outcome (no 'exception never retrieved'); a failure after the decode engine
    answered only matters to the operator."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.debug("SGLang prefill half ended with: %s", exc)
