"""The engine's embedding path (engine.embedding) without HTTP: a prompt run between steps in the engine's
own KV cache, in chunks, reusing its cached prefix, waiting for blocks, dropped when its client leaves, and
never disturbing the generations it runs beside."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.async_engine import AsyncEngine, EngineDead
from engine.embedding import EmbedQueue, last_hidden_state
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_runner import ModelRunner
from engine.sequence import CacheNamespace, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * j + 3) % 500 for j in range(23)]


def engine(model_dir: Path, **overrides: object) -> LLMEngine:
    options: dict[str, object] = {"block_size": 4, "num_kv_blocks": 64, "device": "cpu", **overrides}
    return LLMEngine(EngineConfig(str(model_dir), **options))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaModel.from_pretrained(str(tiny_model_dir)).eval()


def hidden_of(reference: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out: np.ndarray = reference(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    return out


class Spy:
    """Counts the tokens each forward of the model computes."""

    def __init__(self, runner: ModelRunner) -> None:
        self.model = runner.model
        self.tokens: list[int] = []
        runner.model = self  # type: ignore[assignment]

    def __call__(self, ids: torch.Tensor, *args: Any) -> torch.Tensor:
        self.tokens.append(int(ids.shape[0]))
        out: torch.Tensor = self.model(ids, *args)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_a_long_prompt_runs_in_chunks_of_the_token_budget_and_gives_its_blocks_back(
    tiny_model_dir: Path, reference: Any
) -> None:
    e = engine(tiny_model_dir, max_num_batched_tokens=8)
    assert isinstance(e.runner, ModelRunner)
    spy = Spy(e.runner)
    free = e.blocks.num_free
    hidden = last_hidden_state(e, "e", PROMPT, CacheNamespace())
    assert hidden is not None
    np.testing.assert_allclose(hidden, hidden_of(reference, PROMPT), atol=1e-4)
    assert spy.tokens == [8, 8, 7]
    assert e.blocks.num_free == free and e.blocks.num_cached == 0  # nothing kept, nothing published
    assert e.blocks.drain_events() == []


def test_a_cached_prefix_is_reused_without_changing_the_embedding(
    tiny_model_dir: Path, reference: Any
) -> None:
    e = engine(tiny_model_dir)
    e.generate([PROMPT], SamplingParams(max_tokens=1))  # caches the prompt's 5 full blocks
    cached = e.blocks.num_cached
    assert isinstance(e.runner, ModelRunner)
    spy = Spy(e.runner)
    hidden = last_hidden_state(e, "e", PROMPT, CacheNamespace())
    assert hidden is not None
    np.testing.assert_allclose(hidden, hidden_of(reference, PROMPT), atol=1e-4)
    assert spy.tokens == [3]  # 20 of 23 positions came from the cache
    salted = last_hidden_state(e, "e", PROMPT, CacheNamespace("tenant-b"))  # another namespace: none shared
    assert salted is not None and spy.tokens[-1] == len(PROMPT)
    assert e.blocks.num_cached == cached


async def test_a_prompt_waits_for_free_blocks_and_a_client_that_leaves_is_dropped(
    tiny_model_dir: Path,
) -> None:
    e = engine(tiny_model_dir, num_kv_blocks=6)  # 24 tokens
    e.add_request("gen", PROMPT[:16], SamplingParams(max_tokens=4))
    e.step()  # holds 4 blocks (5 soon)
    queue, wake = EmbedQueue(), threading.Event()
    waiting = asyncio.ensure_future(queue.embed(e, "e1", PROMPT[5:17], CacheNamespace(), wake))
    leaving = asyncio.ensure_future(queue.embed(e, "e2", PROMPT[:3], CacheNamespace(), wake))
    await asyncio.sleep(0)
    assert wake.is_set() and len(queue) == 2
    queue.run(e)  # 3 blocks needed, 2 free: both wait (in order)
    assert len(queue) == 2 and not waiting.done()
    leaving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await leaving
    await asyncio.sleep(0)  # (the cancellation reaches the job's future in a callback)
    e.abort("gen")
    queue.run(e)
    assert len(queue) == 0
    assert (await waiting).shape == (64,)
    assert leaving.cancelled()
    late = asyncio.ensure_future(queue.embed(e, "e3", PROMPT[:3], CacheNamespace(), wake))
    await asyncio.sleep(0)
    queue.fail_all(EngineDead("the engine failed: boom"))
    with pytest.raises(EngineDead):
        await late


async def test_embeddings_between_steps_leave_the_generations_beside_them_unchanged(
    tiny_model_dir: Path, reference: Any
) -> None:
    alone = engine(tiny_model_dir).generate([PROMPT], GREEDY)[0]
    served = AsyncEngine(engine(tiny_model_dir, max_num_batched_tokens=8))
    served.start()
    try:

        async def generation() -> list[int]:
            return [
                t for out in [o async for o in served.generate("g", PROMPT, GREEDY)] for t in out.token_ids
            ]

        prompts = [PROMPT[:5], PROMPT[3:20], PROMPT]
        tokens, *hidden = await asyncio.gather(
            generation(), *(served.embed(f"e{i}", p) for i, p in enumerate(prompts))
        )
    finally:
        await served.stop()
    assert tokens == alone
    for got, prompt in zip(hidden, prompts, strict=True):
        np.testing.assert_allclose(got, hidden_of(reference, prompt), atol=1e-4)
