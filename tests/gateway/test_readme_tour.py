"""The README's "A short tour", replayed: its shell commands run against a real ``kvgate demo`` (kvgate's
engine with the tiny random model) and against ``kvgate demo --simulated``, and what they print must match
the outputs the tour shows.

The tour is read from README.md: a ``sh`` block is a command, the plain block right after it (if any) what
it prints; a ``python`` block runs as it is. In a shown output ``…`` stands for what changes from run to
run (ids, dates, generated text): within a line it matches any text, a line of its own any lines. The
simulated engine counts bytes as tokens, so there the token counts and costs may differ (the tour says
which they are); every header, route, engine, field name and routing count must still match.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from gateway.demo import free_port

README = Path(__file__).resolve().parents[2] / "README.md"
KVGATE = [sys.executable, "-m", "gateway.cli"]
GAP = "…"
NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"
# What the simulated engine's byte "tokenizer" changes: token counts and what they cost.
MODE_DEPENDENT = [
    re.compile(r'("(?:prompt_tokens|completion_tokens|total_tokens|cached_tokens|cost)":)' + NUMBER),
    re.compile(r"^(x-kvgate-predicted-cached-tokens: )\d+$"),
    re.compile(r"^(kvgate_(?:cached_)?prompt_tokens_total\{[^}]*\} )" + NUMBER + "$"),
]


@dataclass(frozen=True)
class Step:
    language: str  # "sh" or "python"
    code: str
    shown: str | None  # the output the tour shows for it, if any


def tour_text() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## A short tour\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def tour_steps(text: str) -> list[Step]:
    blocks = re.findall(r"^```(\w*)\n(.*?)^```\n", text, flags=re.M | re.S)
    steps: list[Step] = []
    for i, (language, body) in enumerate(blocks):
        if language in ("sh", "python"):
            follows = blocks[i + 1] if i + 1 < len(blocks) else None
            shown = follows[1] if follows is not None and follows[0] == "" else None
            steps.append(Step(language, body, shown))
    return steps


def _line_pattern(line: str, relax: bool) -> re.Pattern[str]:
    placeholder = "\x00"
    if relax:
        for pattern in MODE_DEPENDENT:
            line = pattern.sub(lambda m: m.group(1) + placeholder, line)
    parts = [re.escape(p).replace(placeholder, NUMBER) for p in line.split(GAP)]
    return re.compile(".*?".join(parts))


def matches(shown: str, printed: str, *, relax: bool = False) -> bool:
    """Whether ``printed`` is what the tour ``shown`` (``…`` for any text; a ``…`` line for any lines)."""
    expected = shown.rstrip("\n").split("\n")
    actual = printed.replace("\r\n", "\n").rstrip("\n").split("\n")
    patterns = [None if line == GAP else _line_pattern(line, relax) for line in expected]

    @cache
    def match(i: int, j: int) -> bool:
        if i == len(patterns):
            return j == len(actual)
        pattern = patterns[i]
        if pattern is None:  # any number of lines
            return any(match(i + 1, k) for k in range(j, len(actual) + 1))
        return j < len(actual) and pattern.fullmatch(actual[j]) is not None and match(i + 1, j + 1)

    return match(0, 0)


def test_the_matcher_fails_on_a_difference() -> None:
    shown = 'x-kvgate-route: session\n…\n{"id":"c-…","usage":{"cached_tokens":48}}\n'
    printed = 'x-kvgate-route: session\r\nDate: now\r\n\r\n{"id":"c-12","usage":{"cached_tokens":48}}\n'
    assert matches(shown, printed)
    assert not matches(shown, printed.replace("session", "miss"))
    assert not matches(shown, printed.replace("48", "32"))
    assert matches(shown, printed.replace("48", "32"), relax=True)
    assert not matches(shown, printed.replace("cached_tokens", "cached"), relax=True)
    assert not matches(shown, printed + "one line too many\n")


def test_the_tour_has_commands_and_their_outputs() -> None:
    steps = tour_steps(tour_text())
    shown = [s for s in steps if s.shown is not None]
    assert len(shown) >= 3 and any(s.language == "python" for s in steps)
    everything = "".join(s.shown or "" for s in steps)
    for fact in ("x-kvgate-route: session", "x-kvgate-home-region: ", '"cached_tokens":', '"cost":'):
        assert fact in everything, fact
    assert "kvgate_routing_decisions_total" in everything


@dataclass
class Demo:
    mode: str
    base: str
    port: int


@pytest.fixture(scope="module", params=["real", "simulated"])
def demo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    mode = str(request.param)
    if shutil.which("curl") is None:
        pytest.skip("the tour's commands need curl")
    if mode == "real" and importlib.util.find_spec("torch") is None:
        pytest.skip("kvgate's engine needs torch (the demo would run simulated engines)")
    cache_dir = tmp_path_factory.mktemp(f"tour-{mode}")
    port = free_port()
    log = (cache_dir / "demo.log").open("wb")
    process = subprocess.Popen(
        [*KVGATE, "demo", "--port", str(port), *(["--simulated"] if mode == "simulated" else [])],
        stdout=log,
        stderr=subprocess.STDOUT,
        # The demo writes its tiny model into the cache directory: keep it inside the test's.
        env={**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(cache_dir)},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"the demo never answered:\n{(cache_dir / 'demo.log').read_text()[-3000:]}")
                time.sleep(0.2)
        yield Demo(mode, base, port)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _served_model(base: str) -> str:
    with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
        models = [m["id"] for m in json.loads(r.read())["data"]]
    assert len(models) == 1, models
    return str(models[0])


def test_the_tour_prints_what_the_readme_shows(demo: Demo) -> None:
    text = tour_text()
    steps = tour_steps(text)
    readme_model = re.findall(r'"model": "([^"]+)"', text)[0]
    model = _served_model(demo.base)
    if model != readme_model:  # then the tour must say which model this demo serves instead
        assert f"`kvgate demo --{demo.mode}`" in text and f"`{model}`" in text, (
            f"the tour's model {readme_model!r} is not what `kvgate demo --{demo.mode}` serves ({model!r}), "
            "and the tour does not say so"
        )

    def localise(code: str) -> str:
        for host in ("localhost:8080", "127.0.0.1:8080"):
            code = code.replace(host, f"127.0.0.1:{demo.port}")
        return code.replace(f'"{readme_model}"', f'"{model}"')

    printed_all = ""
    for step in steps:
        if step.language == "python":
            continue  # below, after the shell commands: it starts a new conversation
        result = subprocess.run(
            ["bash", "-o", "pipefail", "-c", localise(step.code)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, (step.code, result.stderr)
        printed_all += result.stdout
        if step.shown is not None:
            assert matches(step.shown, result.stdout, relax=demo.mode != "real"), (
                f"the tour shows\n{step.shown}\nfor\n{step.code}\nbut it printed\n{result.stdout}"
            )

    # What the relaxed comparison let through must still add up, and be what the tour says it is.
    usages = [json.loads(u) for u in re.findall(r'"usage":(\{[^}]*\{[^}]*\}[^}]*\})', printed_all)]
    assert len(usages) == 3 and all(isinstance(u["cost"], float) and u["cost"] > 0 for u in usages)
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and usages[2]["prompt_tokens_details"]["cached_tokens"] == cached
    assert f"x-kvgate-predicted-cached-tokens: {cached}\n" in printed_all
    assert usages[1]["cost"] < usages[0]["cost"]  # cached input is cheaper
    metrics = dict(
        re.findall(r"^(kvgate_(?:cached_)?prompt_tokens_total)\{[^}]*\} (\S+)$", printed_all, re.M)
    )
    assert float(metrics["kvgate_prompt_tokens_total"]) == sum(u["prompt_tokens"] for u in usages)
    assert float(metrics["kvgate_cached_prompt_tokens_total"]) == 2 * cached
    if demo.mode == "simulated":  # the counts the tour gives for the simulated engine
        said = re.search(r"(\d+) prompt tokens, (\d+) of them\s+cached", text)
        assert said is not None
        assert (usages[1]["prompt_tokens"], cached) == (int(said.group(1)), int(said.group(2)))

    (python,) = [s for s in steps if s.language == "python"]
    if importlib.util.find_spec("openai") is None:
        return
    runs = [
        subprocess.run(
            [sys.executable, "-c", localise(python.code)], capture_output=True, text=True, timeout=60
        )
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    first, again = (int(r.stdout.strip()) for r in runs)
    assert first == 0 and again > 0  # as its comment says
