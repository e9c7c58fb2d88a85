"""A tool-calling chat template in the shape Qwen2.5 and Qwen3-VL checkpoints ship (data):
`tools` in the system turn, assistant `tool_calls` as hermes `<tool_call>` blocks, `tool`
results (text or image parts) in `<tool_response>`, and Qwen3's `enable_thinking` switch.
Newlines after a block tag are written `{{ NL }}` (the renderer trims a block's first newline,
as Hugging Face's does)."""

from __future__ import annotations

TOOL_CHAT_TEMPLATE = (
    "{% set NL = '\\n' %}"
    "{% macro render(content) %}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ render(messages[0]['content']) }}{{ NL }}{{ NL }}"
    "{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ NL }}{{ tool | tojson }}{% endfor %}"
    "{{ NL }}</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ render(messages[0]['content']) }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user"
    "{% endif %}"
    "{{ NL }}<tool_response>\n{{ render(message['content']) }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n"
    "{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ render(message['content']) }}"
    "{% for call in message.get('tool_calls', []) %}"
    "{% if not loop.first or message['content'] %}{{ NL }}{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n"
    "{% endif %}"
    "{% endif %}"
)
