"""KV transfers between real engines whose caches live on a GPU (skipped without CUDA): a pull from a
peer's prefix cache and a disaggregated prefill give the tokens a single engine on the GPU gives."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import SamplingParams
from tests.engine.kv_nodes import BS, complete, prompt, start_node

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def on_gpu(model_dir: Path, ids: list[int]) -> list[int]:
    engine = LLMEngine(EngineConfig(str(model_dir), block_size=BS, num_kv_blocks=256, device="cuda"))
    return engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]


async def test_a_pull_and_a_remote_prefill_match_one_gpu_engine(tiny_model_dir: Path) -> None:
    source = await start_node(tiny_model_dir, "both", "src", device="cuda")
    target = await start_node(tiny_model_dir, "both", "dst", device="cuda")
    prefill = await start_node(tiny_model_dir, "prefill", "p0", device="cuda")
    ids = prompt(300)
    turn = [*ids, 9, 8, 7]
    try:
        async with aiohttp.ClientSession() as session:
            status, _, _ = await complete(session, source, ids, temperature=0)
            assert status == 200
            pull = {"pull_url": source.url, "pull_tokens": len(ids)}
            status, body, headers = await complete(
                session, target, turn, temperature=0, kv_transfer_params=pull
            )
            assert status == 200 and headers["x-kvgate-kv-transfer"] == "pull"
            assert int(headers["x-kvgate-kv-transferred-tokens"]) == len(ids) // BS * BS
            expected = on_gpu(tiny_model_dir, turn)
            assert body["choices"][0]["text"] == target.server.llm.tokenizer.decode(expected)
            status, body, headers = await complete(session, target, prompt(200, 7), prefill, temperature=0)
            assert status == 200 and headers["x-kvgate-kv-transfer"] == "remote"
            expected = on_gpu(tiny_model_dir, prompt(200, 7))
            assert body["choices"][0]["text"] == target.server.llm.tokenizer.decode(expected)
    finally:
        for node in (source, target, prefill):
            await node.runner.cleanup()
