"""The bench tools' own mechanics, where a mistake would silently measure the wrong thing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from bench_gateway_overhead import tree_launch


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
