"""Chat templates that render what agents send (tools, tool calls, reasoning, template variables), for tests
that compare kvgate's rendering with transformers' and with real vLLM's.

TOOLS_CHATML renders a chat without any of those exactly as engine.make_model's CHAT_TEMPLATE (plain ChatML)
does, so scripts/test-vllm can serve it to every integration test: only chats that carry them change.
"""

from __future__ import annotations

# As Qwen2.5/Qwen3 templates: the tools written into a system message first (each as JSON), tool calls'
# arguments written out with tojson (objects, as vLLM hands them over), a thinking switch, documents.
TOOLS_CHATML = (
    "{%- if tools or documents %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "{%- if tools %}# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}{% endif %}"
    "{%- if documents %}\n# Documents\n{%- for doc in documents %}\n{{ doc | tojson }}{%- endfor %}"
    "{%- endif %}"
    "<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not ((tools or documents) and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['reasoning_content'] is defined %}<think>{{ message['reasoning_content'] }}</think>"
    "{%- endif %}"
    "{%- if message['name'] is defined %}[{{ message['name'] }}] {% endif %}"
    "{{ message['content'] }}"
    "{%- if message['tool_calls'] is defined %}{%- for call in message['tool_calls'] %}\n<tool_call>"
    '{"name": {{ call["function"]["name"] | tojson }}, '
    '"arguments": {{ call["function"]["arguments"] | tojson }}}'
    "</tool_call>{%- endfor %}{%- endif %}"
    "{%- if message['tool_call_id'] is defined %} ({{ message['tool_call_id'] }}){% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{%- if style is defined %}({{ style }}) {% endif %}"
    "{%- endif %}"
)

# Templates that write out everything they are given, for comparisons with vLLM (every key of every message,
# in order, with tojson; then the content as it is, where continue_final_message cuts the text; the tools; the
# variables requests set). DUMP is given each content as a string and does not know the developer role;
# DUMP_PARTS loops over a message's content (so it is given parts) and knows it.
_DUMP_HEAD = (
    "{%- if tools is not none %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message | tojson }}\n"
)
_DUMP_TAIL = (
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{{ reasoning_effort | default('-') }} {{ enable_thinking | default('-') }} {{ style | default('-') }}\n"
    "{%- endif %}"
)
DUMP = _DUMP_HEAD + "{{ message['content'] }}" + _DUMP_TAIL
DUMP_PARTS = (
    _DUMP_HEAD
    + "{%- if message['role'] == 'developer' %}(developer) {% endif %}"
    + "{%- if message['content'] is string %}{{ message['content'] }}{% else %}"
    + "{%- for part in message['content'] %}[{{ part['text'] }}]{% endfor %}{% endif %}"
    + _DUMP_TAIL
)
