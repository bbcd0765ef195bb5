"""Responses API requests rendered by kvgate (cache.responses_input, then the chat path in vLLM's dialect)
against vLLM 0.32 itself: its OnlineRenderer.render_responses, the path ``POST /v1/responses`` takes, in
vLLM's own venv (tests/integration/vllm_responses_reference.py), on a tiny model with three chat templates.

Dev-only: it needs vLLM's venv (``scripts/test-vllm --venv-only`` makes .venv-vllm) but no engine. Run it with
``KVGATE_VLLM_VENV=.venv-vllm python -m pytest tests/integration/test_vllm_responses.py``; scripts/test-vllm
runs it too (fleet phase). It also checks that the expected values tests/cache/test_responses_input.py holds
are vLLM's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cache.chat_dialect import VLLM, ChatContentError
from cache.chat_template import render_messages
from cache.responses_input import responses_chat_body
from cache.tokens import load_tokenizer
from tests.cache.test_responses_input import EXPECTED, vllm_view
from tests.chat_templates import DUMP, DUMP_PARTS, TOOLS_CHATML
from tests.responses_cases import CASES, REFUSED

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVGATE_VLLM_VENV", ROOT / ".venv-vllm"))
TEMPLATES = {"tools-chatml": TOOLS_CHATML, "dump": DUMP, "dump-parts": DUMP_PARTS}
ALL = {**CASES, **{name: (body, None, None) for name, (body, _) in REFUSED.items()}}

pytestmark = pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason=f"no vLLM venv at {VENV}")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model once per template (its tokenizer_config.json names the template)."""
    from engine import make_model

    base = make_model.make_model(tmp_path_factory.mktemp("tiny") / "m", "tiny", arch="llama", seed=0)
    dirs = {}
    for name, source in TEMPLATES.items():
        directory = tmp_path_factory.mktemp(name) / "m"
        shutil.copytree(base, directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "chat_template": source}))
        dirs[name] = directory
    return dirs


@pytest.fixture(scope="module")
def vllm(model_dirs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """vLLM's answer for every template and case (one run: vLLM takes ~20 s to import)."""
    given = {"model_dir": str(model_dirs["dump"]), "templates": TEMPLATES, "cases": ALL}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": ""}
    done = subprocess.run(
        [str(VENV / "bin" / "python"), str(Path(__file__).with_name("vllm_responses_reference.py"))],
        input=json.dumps(given),
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        pytest.fail(f"vLLM's reference run failed ({done.returncode})")
    answer: dict[str, dict[str, Any]] = json.loads(done.stdout)
    return answer


def _ours(model_dir: Path, name: str) -> dict[str, Any]:
    body, history, previous_output = ALL[name]
    tokenizer = load_tokenizer(model_dir)
    try:
        chat = responses_chat_body(body, history, previous_output)
        prompt = render_messages(tokenizer, chat["messages"], dialect=VLLM, inputs=VLLM.chat_inputs(chat))
    except ChatContentError as exc:
        return {"error": str(exc), "param": exc.param}
    return {"prompt": prompt, "token_ids": tokenizer.encode(prompt).tolist()}


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("name", list(ALL))
def test_a_responses_request_renders_to_vllms_prompt(
    vllm: dict[str, dict[str, Any]], model_dirs: dict[str, Path], template: str, name: str
) -> None:
    theirs, ours = vllm[template][name], _ours(model_dirs[template], name)
    if "error" in theirs:  # (both refuse it: vLLM's pydantic errors name no field)
        assert "error" in ours, theirs
        return
    assert "error" not in ours, (ours, theirs)
    assert ours["prompt"] == theirs["prompt"]
    assert ours["token_ids"] == theirs["token_ids"]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_unit_tests_expect_what_vllm_does(vllm: dict[str, dict[str, Any]], name: str) -> None:
    theirs = vllm["dump"][name]
    assert json.dumps(vllm_view(theirs["conversation"], theirs["kwargs"])) == json.dumps(EXPECTED[name])


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_vllm_refuses_the_gateway_refuses_naming_the_field(
    vllm: dict[str, dict[str, Any]], model_dirs: dict[str, Path], name: str
) -> None:
    theirs, ours = vllm["dump"][name], _ours(model_dirs["dump"], name)
    assert "error" in theirs and "error" in ours
    assert ours["param"] == REFUSED[name][1]
    if theirs["param"] is not None:
        assert ours["param"] == theirs["param"]
