"""What the OpenAI Python SDK sends, one valid value of each parameter and each shape of message, content
part, tool and input item its request types (``openai.types``: chat, completion, embedding and response
create params) allow, plus vLLM's ``extra_body`` fields: the cases of tests/gateway/test_sdk_sweep.py.

A case is (name, keyword arguments of the SDK call). ``ENGINE_REFUSES`` names the cases the engine behind the
gateway refuses itself: the gateway must still forward them unchanged, and relay the engine's 400.
"""

from __future__ import annotations

from typing import Any

Case = tuple[str, dict[str, Any]]

HELLO = [{"role": "user", "content": "hello there"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather",
        "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}

CHAT: list[Case] = [
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}),
    ("modalities", {"modalities": ["text"]}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("presence_penalty", {"presence_penalty": -0.5}),
    ("penalties_as_ints", {"frequency_penalty": 1, "presence_penalty": 0}),
    ("functions", {"functions": [{"name": "f", "description": "x", "parameters": {"type": "object"}}]}),
    (
        "function_call",
        {"function_call": "auto", "functions": [{"name": "f", "parameters": {"type": "object"}}]},
    ),
    ("function_call_named", {"function_call": {"name": "f"}, "functions": [{"name": "f"}]}),
    ("logit_bias", {"logit_bias": {"50256": -100, "7": 5}}),
    ("logprobs", {"logprobs": True, "top_logprobs": 3}),
    ("top_logprobs_0", {"logprobs": True, "top_logprobs": 0}),
    ("max_completion_tokens", {"max_completion_tokens": 5}),
    ("max_tokens", {"max_tokens": 5}),
    ("metadata", {"metadata": {"k": "v"}, "store": True}),
    ("n", {"n": 2}),
    ("n_streamed", {"n": 2, "stream": True, "stream_options": {"include_usage": True}}),
    ("parallel_tool_calls", {"parallel_tool_calls": False, "tools": [TOOL]}),
    ("prediction", {"prediction": {"type": "content", "content": "hello"}}),
    ("prediction_parts", {"prediction": {"type": "content", "content": [{"type": "text", "text": "hello"}]}}),
    ("prompt_cache_key", {"prompt_cache_key": "conversation-1"}),
    ("prompt_cache_retention", {"prompt_cache_retention": "24h"}),
    ("prompt_cache_retention_in_memory", {"prompt_cache_retention": "in-memory"}),
    *[
        (f"reasoning_effort_{e}", {"reasoning_effort": e})
        for e in ("none", "minimal", "low", "high", "xhigh")
    ],
    ("response_format_text", {"response_format": {"type": "text"}}),
    ("response_format_json_object", {"response_format": {"type": "json_object"}}),
    (
        "response_format_json_schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "description": "d",
                    "schema": {"type": "object"},
                    "strict": True,
                },
            }
        },
    ),
    ("safety_identifier", {"safety_identifier": "user-1"}),
    ("seed", {"seed": 42}),
    ("seed_negative", {"seed": -5}),
    *[(f"service_tier_{t}", {"service_tier": t}) for t in ("auto", "default", "flex", "scale", "priority")],
    ("stop_string", {"stop": "\n"}),
    ("stop_list", {"stop": ["a", "b"]}),
    ("stop_null", {"stop": None}),
    ("store", {"store": False}),
    ("stream", {"stream": True}),
    (
        "stream_usage",
        {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    ),
    ("stream_obfuscation", {"stream": True, "stream_options": {"include_obfuscation": True}}),
    ("stream_without_usage", {"stream": True, "stream_options": {"include_usage": False}}),
    (
        "moderation",
        {"moderation": {"model": "omni-moderation-latest", "policy": {"input": {"mode": "score"}}}},
    ),
    ("prompt_cache_options", {"prompt_cache_options": {"mode": "explicit", "ttl": "30m"}}),
    ("temperature", {"temperature": 0.7}),
    ("temperature_int", {"temperature": 1}),
    ("top_p", {"top_p": 0.9}),
    ("top_p_int", {"top_p": 1}),
    ("tool_choice_auto", {"tools": [TOOL], "tool_choice": "auto"}),
    ("tool_choice_required", {"tools": [TOOL], "tool_choice": "required"}),
    ("tool_choice_none", {"tools": [TOOL], "tool_choice": "none"}),
    (
        "tool_choice_named",
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    ),
    (
        "tool_choice_allowed_tools",
        {
            "tools": [TOOL],
            "tool_choice": {
                "type": "allowed_tools",
                "allowed_tools": {
                    "mode": "auto",
                    "tools": [{"type": "function", "function": {"name": "get_weather"}}],
                },
            },
        },
    ),
    ("user", {"user": "user-1"}),
    ("verbosity", {"verbosity": "low"}),
    (
        "web_search_options",
        {
            "web_search_options": {
                "search_context_size": "low",
                "user_location": {"type": "approximate", "approximate": {"city": "Paris", "country": "FR"}},
            }
        },
    ),
    ("vllm_sampling", {"extra_body": {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 1}}),
    ("vllm_top_k_off", {"extra_body": {"top_k": -1}}),
    ("vllm_ignore_eos", {"extra_body": {"ignore_eos": True}}),
    ("vllm_chat_template_kwargs", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}),
    ("vllm_guided_json", {"extra_body": {"guided_json": {"type": "object"}}}),
    ("vllm_structured_outputs", {"extra_body": {"structured_outputs": {"json": {"type": "object"}}}}),
    ("vllm_stop_token_ids", {"extra_body": {"stop_token_ids": [1, 2]}}),
    (
        "vllm_special_tokens",
        {"extra_body": {"skip_special_tokens": False, "include_stop_str_in_output": True}},
    ),
    (
        "vllm_generation_prompt",
        {"extra_body": {"add_generation_prompt": True, "continue_final_message": False}},
    ),
    ("vllm_priority", {"extra_body": {"priority": 0, "bad_words": ["x"], "length_penalty": 1.0}}),
    ("vllm_documents", {"extra_body": {"documents": [{"title": "t", "text": "x"}]}}),
    ("vllm_xargs", {"extra_body": {"vllm_xargs": {"a": 1}, "mm_processor_kwargs": {}}}),
    # Messages: every role and content shape.
    (
        "prompt_cache_breakpoint",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": "a long prefix",
                            "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"},
                        },
                        {"type": "text", "text": "the question"},
                    ],
                }
            ]
        },
    ),
    ("developer_named", {"messages": [{"role": "developer", "content": "be terse", "name": "dev"}, *HELLO]}),
    (
        "system_parts",
        {"messages": [{"role": "system", "content": [{"type": "text", "text": "be terse"}]}, *HELLO]},
    ),
    ("user_named", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}),
    (
        "user_text_parts",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        },
    ),
    (
        "user_image_url",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it"}, IMAGE]}]},
    ),
    ("user_image_only", {"messages": [{"role": "user", "content": [IMAGE]}]}),
    (
        "user_input_audio",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "transcribe"},
                        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                    ],
                }
            ]
        },
    ),
    (
        "user_file_data",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "file",
                            "file": {
                                "file_data": "data:application/pdf;base64,JVBERi0=",
                                "filename": "a.pdf",
                            },
                        }
                    ],
                }
            ]
        },
    ),
    (
        "user_file_id",
        {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}]},
    ),
    (
        "assistant_tool_calls",
        {
            "tools": [TOOL],
            "messages": [
                *HELLO,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
        },
    ),
    (
        "tool_result_parts",
        {
            "messages": [
                *HELLO,
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
            ]
        },
    ),
    (
        "assistant_refusal",
        {
            "messages": [
                *HELLO,
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}], "refusal": "no"},
                {"role": "user", "content": "ok"},
            ]
        },
    ),
    (
        "assistant_parts_named",
        {
            "messages": [
                *HELLO,
                {"role": "assistant", "content": [{"type": "text", "text": "hi"}], "name": "a"},
                {"role": "user", "content": "ok"},
            ]
        },
    ),
    (
        "assistant_audio",
        {
            "messages": [
                *HELLO,
                {"role": "assistant", "audio": {"id": "audio_1"}},
                {"role": "user", "content": "ok"},
            ]
        },
    ),
    (
        "assistant_empty",
        {"messages": [*HELLO, {"role": "assistant", "content": ""}, {"role": "user", "content": "ok"}]},
    ),
    (
        "assistant_function_call",
        {
            "messages": [
                *HELLO,
                {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                {"role": "function", "name": "f", "content": "done"},
            ]
        },
    ),
    ("function_result_null", {"messages": [*HELLO, {"role": "function", "name": "f", "content": None}]}),
]

COMPLETION: list[Case] = [
    ("best_of", {"best_of": 2, "n": 1}),
    ("echo", {"echo": True}),
    ("frequency_penalty", {"frequency_penalty": 0.5, "presence_penalty": -0.5}),
    ("logit_bias", {"logit_bias": {"50256": -100}}),
    ("logprobs", {"logprobs": 2}),
    ("logprobs_0", {"logprobs": 0}),
    ("max_tokens", {"max_tokens": 5}),
    ("n", {"n": 2}),
    ("seed", {"seed": 1}),
    ("stop_string", {"stop": "x"}),
    ("stop_list", {"stop": ["x", "y"]}),
    ("stream", {"stream": True}),
    (
        "stream_usage",
        {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}},
    ),
    ("stream_without_usage", {"stream": True, "stream_options": {"include_usage": False}}),
    ("suffix", {"suffix": "end"}),
    ("temperature", {"temperature": 0.1, "top_p": 0.5}),
    ("user", {"user": "user-1"}),
    ("prompts", {"prompt": ["a b", "c d"]}),
    (
        "prompts_streamed",
        {"prompt": ["a b", "c d"], "stream": True, "stream_options": {"include_usage": True}},
    ),
    ("n_streamed", {"n": 2, "stream": True, "stream_options": {"include_usage": True}}),
    ("token_ids", {"prompt": [1, 2, 3]}),
    ("token_id_lists", {"prompt": [[1, 2], [3, 4]]}),
    (
        "vllm_sampling",
        {"extra_body": {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True}},
    ),
    (
        "vllm_guided",
        {"extra_body": {"guided_json": {"type": "object"}, "structured_outputs": {"regex": "a+"}}},
    ),
    ("vllm_response_format", {"extra_body": {"response_format": {"type": "json_object"}}}),
    ("vllm_truncate", {"extra_body": {"truncate_prompt_tokens": 100, "add_special_tokens": False}}),
]

EMBEDDING: list[Case] = [
    ("base64", {"input": "hello"}),
    ("float", {"input": "hello", "encoding_format": "float"}),
    ("strings", {"input": ["a", "b"]}),
    ("token_ids", {"input": [1, 2, 3]}),
    ("token_id_lists", {"input": [[1, 2], [3]]}),
    ("dimensions", {"input": "x", "dimensions": 8}),
    ("user", {"input": "x", "user": "user-1"}),
    ("vllm_truncate", {"input": "x", "extra_body": {"truncate_prompt_tokens": 3, "priority": 0}}),
    ("vllm_normalize", {"input": "x", "extra_body": {"normalize": True}}),
]
# The engines' own refusals: the vLLM stand-in serves a text model (a vision model's vLLM takes the media),
# the simulated engine embeds in 64 dimensions and, as vLLM 0.32, no longer knows ``normalize``.
ENGINE_REFUSES = {
    *(
        f"chat:{name}"
        for name in (
            "user_image_url",
            "user_image_only",
            "user_input_audio",
            "user_file_data",
            "user_file_id",
        )
    ),
    "embeddings:dimensions",
    "embeddings:vllm_normalize",
}

RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object"},
    "strict": True,
    "description": "the weather",
}
ASKED = {"role": "user", "content": "hi"}


def _answered(part: dict[str, Any]) -> dict[str, Any]:
    """A Responses output message of the assistant, as a client sends an earlier answer back: ``part`` its
    content."""
    return {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": [part]}


RESPONSES: list[Case] = [
    ("string", {"input": "hi"}),
    ("instructions", {"input": "hi", "instructions": "be terse"}),
    (
        "easy_messages",
        {
            "input": [
                {"role": "developer", "content": "x"},
                ASKED,
                {"role": "assistant", "content": "yo"},
                ASKED,
            ]
        },
    ),
    (
        "message_items",
        {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
    ),
    (
        "input_image",
        {
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "what"},
                        {"type": "input_image", "image_url": "data:image/png;base64,iVBO", "detail": "auto"},
                    ],
                }
            ]
        },
    ),
    (
        "input_file",
        {
            "input": [
                {"role": "user", "content": [{"type": "input_file", "file_data": "x", "filename": "a.pdf"}]}
            ]
        },
    ),
    (
        "output_message",
        {
            "input": [
                ASKED,
                _answered({"type": "output_text", "text": "yo", "annotations": []}),
                ASKED,
            ]
        },
    ),
    (
        "function_call_items",
        {
            "tools": [RESPONSES_TOOL],
            "input": [
                ASKED,
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": "{}",
                    "id": "fc_1",
                    "status": "completed",
                },
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
        },
    ),
    (
        "function_output_parts",
        {
            "tools": [RESPONSES_TOOL],
            "input": [
                ASKED,
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [
                        {"type": "input_text", "text": "sunny"},
                        {"type": "input_image", "image_url": "data:image/png;base64,iVBO"},
                    ],
                },
            ],
        },
    ),
    (
        "reasoning_item",
        {
            "input": [
                ASKED,
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "t"}]},
                ASKED,
            ]
        },
    ),
    ("max_output_tokens", {"input": "hi", "max_output_tokens": 16}),
    ("metadata", {"input": "hi", "metadata": {"a": "b"}}),
    ("parallel_tool_calls", {"input": "hi", "parallel_tool_calls": True, "tools": [RESPONSES_TOOL]}),
    ("tool_choice_auto", {"input": "hi", "tool_choice": "auto", "tools": [RESPONSES_TOOL]}),
    (
        "tool_choice_function",
        {
            "input": "hi",
            "tool_choice": {"type": "function", "name": "get_weather"},
            "tools": [RESPONSES_TOOL],
        },
    ),
    (
        "prompt_cache_key",
        {"input": "hi", "prompt_cache_key": "conversation-1", "prompt_cache_retention": "24h"},
    ),
    ("reasoning", {"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}),
    ("safety_identifier", {"input": "hi", "safety_identifier": "s", "service_tier": "default", "user": "u"}),
    ("store_false", {"input": "hi", "store": False}),
    ("stream", {"input": "hi", "stream": True, "stream_options": {"include_obfuscation": False}}),
    (
        "sampling",
        {
            "input": "hi",
            "temperature": 1,
            "top_p": 0.9,
            "top_logprobs": 2,
            "include": ["message.output_text.logprobs"],
        },
    ),
    ("text_format", {"input": "hi", "text": {"format": {"type": "text"}, "verbosity": "low"}}),
    (
        "text_json_schema",
        {
            "input": "hi",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        },
    ),
    ("truncation", {"input": "hi", "truncation": "auto", "max_tool_calls": 3}),
    ("vllm_sampling", {"input": "hi", "extra_body": {"top_k": 4, "repetition_penalty": 1.1}}),
    ("tool_web_search", {"input": "hi", "tools": [{"type": "web_search"}]}),
    (
        "tool_mcp",
        {"input": "hi", "tools": [{"type": "mcp", "server_label": "s", "server_url": "http://mcp"}]},
    ),
    (
        "tool_custom",
        {
            "input": "hi",
            "tools": [{"type": "custom", "name": "c"}],
            "tool_choice": {"type": "custom", "name": "c"},
        },
    ),
    ("tool_choice_required", {"input": "hi", "tools": [RESPONSES_TOOL], "tool_choice": "required"}),
    (
        "tool_choice_allowed_tools",
        {
            "input": "hi",
            "tools": [RESPONSES_TOOL],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": "get_weather"}],
            },
        },
    ),
    (
        "custom_tool_call_items",
        {
            "tools": [{"type": "custom", "name": "c"}],
            "input": [
                ASKED,
                {"type": "custom_tool_call", "call_id": "c1", "name": "c", "input": "x"},
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "r"},
            ],
        },
    ),
    (
        "reasoning_content",
        {
            "input": [
                ASKED,
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "t"}],
                },
                ASKED,
            ]
        },
    ),
    (
        "system_item",
        {
            "input": [
                {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "s"}]},
                ASKED,
            ]
        },
    ),
    ("access_programs", {"input": "hi", "access_programs": {"cyber": "standard"}}),
    (
        "context_management",
        {"input": "hi", "context_management": [{"type": "compaction", "compact_threshold": 1000}]},
    ),
    ("image_options", {"input": "hi", "image": {"context_compression": "auto"}}),
    ("moderation", {"input": "hi", "moderation": {"model": "omni-moderation-latest"}}),
    ("prompt_cache_options", {"input": "hi", "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}}),
    (
        "input_text_breakpoint",
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}}
                    ],
                }
            ]
        },
    ),
]

# Invalid by OpenAI's rules: a 400 naming the parameter, before any engine is asked.
INVALID: list[tuple[str, str, dict[str, Any], str]] = [
    ("chat", "temperature", {"messages": HELLO, "temperature": 3}, "temperature"),
    ("chat", "top_p", {"messages": HELLO, "top_p": 1.5}, "top_p"),
    ("chat", "n", {"messages": HELLO, "n": 0}, "n"),
    ("chat", "max_tokens", {"messages": HELLO, "extra_body": {"max_tokens": "many"}}, "max_tokens"),
    ("chat", "user_without_content", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    (
        "chat",
        "stream_options_alone",
        {"messages": HELLO, "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    ("completions", "presence_penalty", {"prompt": "x", "presence_penalty": 9}, "presence_penalty"),
    (
        "completions",
        "max_completion_tokens",
        {"prompt": "x", "extra_body": {"max_completion_tokens": 3}},
        "max_completion_tokens",
    ),
    ("responses", "temperature", {"input": "hi", "temperature": 5}, "temperature"),
    ("responses", "background", {"input": "hi", "background": True}, "background"),
    ("embeddings", "dimensions", {"input": "x", "dimensions": 0}, "dimensions"),
]

# What the README says the gateway refuses though OpenAI takes it: in front of vLLM, what vLLM cannot render
# (a custom tool, an assistant's custom tool call) or turn into a chat (a Responses prompt template, an
# item_reference, encrypted reasoning, an output message opening with a refusal). A 400 naming the field,
# before any engine.
CUSTOM_TOOL = {"type": "custom", "custom": {"name": "run", "description": "d", "format": {"type": "text"}}}
CUSTOM_CALL = {"id": "c1", "type": "custom", "custom": {"name": "run", "input": "ls"}}
REFUSED_AS_VLLM: list[tuple[str, str, dict[str, Any], str]] = [
    ("chat", "custom_tool", {"messages": HELLO, "tools": [CUSTOM_TOOL]}, "tools[0]"),
    (
        "chat",
        "custom_tool_call",
        {
            "messages": [
                *HELLO,
                {"role": "assistant", "tool_calls": [CUSTOM_CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
            ]
        },
        "messages",
    ),
    (
        "responses",
        "prompt_template",
        {"input": "hi", "prompt": {"id": "pmpt_1", "variables": {"a": "b"}}},
        "prompt",
    ),
    ("responses", "item_reference", {"input": [ASKED, {"type": "item_reference", "id": "msg_1"}]}, "input"),
    (
        "responses",
        "encrypted_reasoning",
        {
            "input": [
                ASKED,
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
                ASKED,
            ]
        },
        "input",
    ),
    (
        "responses",
        "output_refusal",
        {
            "input": [
                ASKED,
                _answered({"type": "refusal", "refusal": "no"}),
                ASKED,
            ]
        },
        "input",
    ),
]
