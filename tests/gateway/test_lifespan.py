"""The tasks a gateway runs for its whole life (KV-event followers, tokenizer checks): one that fails is said
when it fails, and the gateway's stop still runs to its end (the ledger's flush among it)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import gateway.app
from tests.harness import ClusterFactory


async def test_a_failed_background_task_is_logged_at_once_and_the_stop_still_flushes_the_ledger(
    make_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def failing_checks(*args: Any) -> None:
        raise RuntimeError("a bug in the tokenizer checks")

    monkeypatch.setattr(gateway.app, "check_tokenizers_forever", failing_checks)
    caplog.set_level(logging.ERROR, logger="kvgate.app")
    cluster = await make_cluster({"eu-west": 1})
    await cluster.wait_for(lambda: "kvgate-tokenizer-checks stopped on an error" in caplog.text)
    assert "RuntimeError: a bug in the tokenizer checks" in caplog.text

    body = {"model": cluster.model, "prompt": "hello there", "max_tokens": 3}
    status, answer, _ = await cluster.post("/v1/completions", body, headers={"x-request-id": "r-1"})
    assert status == 200, answer
    await cluster.close()  # raised the checks' error before, skipping every stop after the followers'
    billing = cluster.gateway.billing
    assert billing.writer.pending == 0
    assert [r.request_id for r in await billing.ledger.records()] == ["r-1"]
