"""The bench tools' own mechanics, where a mistake would silently measure the wrong thing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from bench_gateway_overhead import tree_launch
from trace_workload import lru_hit_rate, prompt_block_keys

from region_map.simulation.trace import TraceRequest


def test_a_gateway_launched_for_another_tree_runs_that_trees_code(tmp_path: Path) -> None:
    """bench_gateway_cpu compares two source trees: each gateway must import its own tree's modules, not
    this checkout's. ``gateway`` is a namespace package (no __init__.py), so its modules come from the first
    portion on sys.path, and ``python -m`` puts the working directory there before PYTHONPATH."""
    tree = tmp_path / "tree"
    (tree / "gateway").mkdir(parents=True)  # (as this checkout's: no __init__.py)
    (tree / "gateway" / "cli.py").write_text("print(__file__)\n")
    ran = subprocess.run(
        [sys.executable, "-m", "gateway.cli"], capture_output=True, text=True, timeout=60, **tree_launch(tree)
    )
    assert ran.returncode == 0, ran.stderr
    assert Path(ran.stdout.strip()).resolve() == (tree / "gateway" / "cli.py").resolve()


def _prompt(tokens: int, *blocks: int) -> TraceRequest:
    return TraceRequest(arrival_s=0.0, input_tokens=tokens, output_tokens=1, blocks=blocks, conversation=0)


def test_prompt_block_keys_are_shared_exactly_as_far_as_the_replayed_prompts_are() -> None:
    """A trace block is the same 512 tokens anywhere and a prompt's last block is cut at its length, so two
    prompts share a block key exactly while they share every token up to that block's end, also for a
    block size that does not divide 512."""
    whole = _prompt(1024, 1, 2)
    for size, whole_keys in ((16, 64), (100, 10)):
        keys = prompt_block_keys(whole, size)
        assert len(keys) == whole_keys
        cut = prompt_block_keys(_prompt(700, 1, 2), size)  # the same tokens, cut at 700
        assert len(cut) == 700 // size and cut == keys[: 700 // size]
        forked = prompt_block_keys(_prompt(1024, 1, 3), size)  # the same first 512 tokens only
        same = 512 // size
        assert forked[:same] == keys[:same] and forked[same] != keys[same]
        assert prompt_block_keys(_prompt(1024, 2, 2), size)[0] != keys[0]


def test_lru_hit_rate_counts_whole_blocks_less_the_last_token_and_evicts_a_chains_tail_first() -> None:
    a = _prompt(1024, 1, 2)
    # A repeat finds all but its last token, in whole blocks: 1,023 tokens, 1,008 of them in 16-token blocks.
    assert lru_hit_rate([a, a], 16) == 1008 / 2048
    assert lru_hit_rate([a, _prompt(700, 1, 2)], 16) == 688 / 1724  # 43 whole blocks of the 700
    # 64 blocks hold one of a; another prompt of 32 blocks evicts a's tail (its block 2), not its head, so
    # a prompt that starts as a does still finds 512 tokens; so does a's repeat, which an unbounded cache
    # serves whole.
    trace = [a, _prompt(512, 9), _prompt(513, 1, 5), a]
    total = 1024 + 512 + 513 + 1024
    assert lru_hit_rate(trace, 16, capacity_blocks=64) == (512 + 512) / total
    assert lru_hit_rate(trace, 16) == (512 + 1008) / total
