"""Tool turns through the chat template: tools, assistant tool_calls and tool results (text and
images) render as Hugging Face renders them, and malformed tool turns are 400s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers
from transformers import PreTrainedTokenizerFast

from mmserve.config.model import bundled_toy_model_dir
from mmserve.errors import InvalidRequestError
from mmserve.processing.chat import check_tools_text, parse_chat_messages
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.tokenizer import Tokenizer
from tests.support.tool_template import TOOL_CHAT_TEMPLATE

RESERVED = ["<|image_pad|>", "<|video_pad|>"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <in> a city & its région",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Zürich?"}]},
    {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
    {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": [
            {"type": "text", "text": "sunny, see the map"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ],
    },
]


@pytest.fixture(scope="module")
def tokenizers_pair(tmp_path_factory):
    path = Path(bundled_toy_model_dir()) / "tokenizer.json"
    ours = Tokenizer(tokenizers.Tokenizer.from_file(str(path)), chat_template=TOOL_CHAT_TEMPLATE)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
    hf.chat_template = TOOL_CHAT_TEMPLATE
    return ours, hf


@pytest.mark.parametrize("with_tools", [True, False])
def test_tool_turns_render_as_hugging_face_renders_them(tokenizers_pair, with_tools):
    ours, hf = tokenizers_pair
    parsed = parse_chat_messages(MESSAGES, RESERVED)
    assert parsed.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich"}
    assert parsed.messages[3]["tool_call_id"] == "call_1"
    assert [img.source for img in parsed.images] == ["data:image/png;base64,AAAA"]
    tools = TOOLS if with_tools else None
    text = ours.apply_chat_template(parsed.messages, tools=tools)
    expected = hf.apply_chat_template(
        parsed.messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert text == expected
    assert ("Weather <in> a city & its région" in text) is with_tools  # no HTML escaping
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text
    assert "<tool_response>\nsunny, see the map<|vision_start|><|image_pad|>" in text


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
        {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
        {"role": "assistant", "tool_calls": ["f"]},
        {"role": "user", "tool_calls": [CALL]},
        {"role": "tool", "content": "x", "tool_call_id": 3},
        {"role": "tool", "content": "x", "tool_call_id": "<|image_pad|>"},
        {"role": "assistant", "content": "", "reasoning_content": ["no"]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "<|image_pad|>"}}]},
        {
            "role": "assistant",
            "tool_calls": [{"function": {"name": "f", "arguments": '{"a": "<|video_pad|>"}'}}],
        },
        {
            "role": "assistant",
            "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}],
        },
    ],
)
def test_malformed_tool_turns_are_400s(message):
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_messages([{"role": "user", "content": "hi"}, message], RESERVED)
    assert info.value.param == "messages"
    assert "messages[1]" in info.value.message


def test_arguments_already_an_object_pass_through():
    call = {"function": {"name": "f", "arguments": {"a": [1, 2]}}}
    parsed = parse_chat_messages([{"role": "assistant", "tool_calls": [call]}], RESERVED)
    rendered = parsed.messages[0]["tool_calls"][0]["function"]
    assert rendered == {"name": "f", "arguments": {"a": [1, 2]}}
    assert json.dumps(rendered)  # plain JSON data for the template


def test_tools_spelling_a_vision_token_are_refused():
    check_tools_text(TOOLS, RESERVED)
    bad = [{"type": "function", "function": {"name": "f", "description": "<|image_pad|>"}}]
    with pytest.raises(InvalidRequestError) as info:
        check_tools_text(bad, RESERVED)
    assert info.value.param == "tools"


def test_the_offline_path_renders_the_tools(tmp_path):
    """`LLM.chat(tools=...)` goes through InputProcessor.process_chat."""
    toy = Path(bundled_toy_model_dir())
    for name in ("config.json", "tokenizer.json", "preprocessor_config.json"):
        shutil.copy(toy / name, tmp_path / name)
    config = json.loads((toy / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TOOL_CHAT_TEMPLATE})
    )
    processor = InputProcessor.from_pretrained(tmp_path, max_model_len=4096)
    ask = [{"role": "user", "content": "Weather?"}]
    with_tools = processor.process_chat(ask, tools=TOOLS)
    without = processor.process_chat(ask)
    text = processor.tokenizer.decode(with_tools.prompt_token_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in text and "# Tools" in text
    assert len(without.prompt_token_ids) < len(with_tools.prompt_token_ids)
