"""What vLLM 0.32 itself renders for Responses API requests, for tests/integration/test_vllm_responses.py.

Run with vLLM's own Python (``.venv-vllm/bin/python``: vLLM, and none of kvgate), it reads
``{"model_dir", "templates": {name: source}, "cases": {name: [body, history, previous_output]}}`` on stdin
and writes, for each template and case, vLLM's prompt (its text and token ids, from
OnlineRenderer.render_responses: the path ``POST /v1/responses`` takes), the messages its chat template is
given and the template's other inputs; or the error vLLM answers with.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from openai.types.responses import ResponseOutputItem
from pydantic import TypeAdapter, ValidationError
from vllm import AsyncEngineArgs, envs
from vllm.config import VllmConfig
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.exceptions import VLLMValidationError
from vllm.renderers import merge_kwargs, renderer_from_config
from vllm.renderers.chat_utils import parse_chat_messages
from vllm.renderers.hf import (
    _consolidate_system_messages,
    _convert_developer_to_system,
    _detect_developer_role_support,
    resolve_chat_template_content_format,
)
from vllm.renderers.online_renderer import OnlineRenderer

_OUTPUTS = TypeAdapter(list[ResponseOutputItem])


def _refusal(exc: BaseException) -> dict[str, Any]:
    param = getattr(exc, "parameter", None)
    return {"error": f"{type(exc).__name__}: {exc}"[:500], "param": param}


async def _render(online: OnlineRenderer, source: str, case: list[Any]) -> dict[str, Any]:
    body, history, previous_output = case
    try:
        request = ResponsesRequest(model="tiny", **json.loads(json.dumps(body)))
        outputs = None if previous_output is None else _OUTPUTS.validate_python(previous_output)
        result = await online.render_responses(
            request,
            previous_messages=None if history is None else json.loads(json.dumps(history)),
            previous_response_outputs=outputs,
        )
    except (ValidationError, VLLMValidationError, ValueError, AttributeError, IndexError) as exc:
        return _refusal(exc)
    if isinstance(result, ErrorResponse):
        return {"error": result.error.message[:500], "param": result.error.param}
    # What the template is given, as preprocess_chat and safe_apply_chat_template make it (again, on a copy).
    request = ResponsesRequest(model="tiny", **json.loads(json.dumps(body)))
    outputs = None if previous_output is None else _OUTPUTS.validate_python(previous_output)
    messages = construct_input_messages(
        request_instructions=request.instructions,
        request_input=request.input,
        prev_msg=None if history is None else json.loads(json.dumps(history)),
        prev_response_output=outputs,
    )
    tools = construct_tool_dicts(request.tools, request.tool_choice)
    renderer = online.renderer
    content_format = resolve_chat_template_content_format(
        chat_template=source,
        tools=tools,
        given_format="auto",
        tokenizer=renderer.get_tokenizer(),
        model_config=online.model_config,
    )
    conversation, _, _ = parse_chat_messages(messages, online.model_config, content_format)
    if any(m["role"] == "developer" for m in conversation) and not _detect_developer_role_support(source):
        conversation = _consolidate_system_messages(_convert_developer_to_system(conversation))
    defaults = merge_kwargs(
        online.effective_chat_template_kwargs(request), {"tools": tools, "tokenize": False}
    )
    kwargs = request.build_chat_params(source, "auto").with_defaults(defaults).chat_template_kwargs
    engine_input = result.engine_input
    return {
        "prompt": engine_input.get("prompt"),
        "token_ids": engine_input["prompt_token_ids"],
        "conversation": conversation,
        "content_format": content_format,
        "kwargs": {k: v for k, v in kwargs.items() if k != "tokenize"},
    }


async def main() -> None:
    given = json.load(sys.stdin)
    args = AsyncEngineArgs(model=given["model_dir"], served_model_name=["tiny"])
    model_config = args.create_model_config()
    model_config.quantization = None
    envs.VLLM_CPU_KVCACHE_SPACE = 0  # (as `vllm launch render`: no KV cache, no warning about it)
    renderer = renderer_from_config(VllmConfig(model_config=model_config))
    out: dict[str, dict[str, Any]] = {}
    for name, source in given["templates"].items():
        online = OnlineRenderer(
            model_config=model_config,
            renderer=renderer,
            request_logger=None,
            chat_template=source,
            chat_template_content_format="auto",
            trust_request_chat_template=False,
        )
        out[name] = {case: await _render(online, source, given["cases"][case]) for case in given["cases"]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
