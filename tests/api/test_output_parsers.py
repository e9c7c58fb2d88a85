"""The hermes tool-call parser and the qwen3 reasoning parser on text: whole answers, and the
same answers streamed in every split into pieces, which must add up to the whole reading."""

from __future__ import annotations

import json
import random

import pytest

from mmserve.api.chat_output import AnswerParsing, ChoiceParser
from mmserve.api.hermes import HermesStream, parse_tool_calls
from mmserve.api.reasoning import ReasoningStream
from mmserve.api.tools import tool_request

START_ID, END_ID = 1000, 1001
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n</tool_call>'  # noqa: E501
CALL2 = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": "a \\" b"}}\n</tool_call>'


def _splits(text: str, seed: int) -> list[str]:
    """`text` in random pieces (some empty, some single characters)."""
    rng = random.Random(seed)
    pieces, pos = [], 0
    while pos < len(text):
        n = rng.choice([0, 1, 1, 2, 3, 5, 8])
        pieces.append(text[pos : pos + n])
        pos += n
    return pieces


def _stream_hermes(pieces: list[str]) -> tuple[str, dict[int, dict]]:
    stream = HermesStream()
    content, calls = "", {}
    outputs = [stream.feed(p) for p in pieces] + [stream.finish()]
    for text, deltas in outputs:
        content += text
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert call["id"] is None, "a call's id comes once, in its first delta"
                call["id"], call["name"] = d["id"], d["function"]["name"]
                assert d["type"] == "function"
            else:
                assert call["id"] is not None, "arguments before the call's first delta"
                call["arguments"] += d["function"]["arguments"]
    return content, calls


def test_whole_answer_with_calls():
    content, calls = parse_tool_calls("Let me check. " + CALL + CALL2)
    assert content == "Let me check. "
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "n": [1, {"a": "}"}]}
    assert json.loads(calls[1].arguments) == {"x": 1, "y": 'a " b'}
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_whole_answer_edge_cases():
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    only_call = parse_tool_calls(CALL)
    assert only_call[0] is None and len(only_call[1]) == 1
    # unclosed at the end but complete JSON: still a call (vLLM reads it too)
    unclosed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert unclosed[1][0].name == "f" and unclosed[1][0].arguments == "{}"
    # a call that does not parse: the whole answer is content, no calls
    broken = "text <tool_call>{not json</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == []


@pytest.mark.parametrize("seed", range(40))
def test_streamed_calls_add_up_to_the_whole_reading(seed):
    text = "Sure: " + CALL + "\n" + CALL2
    content, calls = _stream_hermes(_splits(text, seed))
    whole_content, whole_calls = parse_tool_calls(text)
    assert content == whole_content
    assert [calls[i]["name"] for i in sorted(calls)] == [c.name for c in whole_calls]
    for i, call in enumerate(whole_calls):
        assert json.loads(calls[i]["arguments"]) == json.loads(call.arguments)


@pytest.mark.parametrize("seed", range(10))
def test_streamed_text_without_calls_comes_back_whole(seed):
    text = "a < b and <tool is not a tag <tool_cal"
    content, calls = _stream_hermes(_splits(text, seed))
    assert (content, calls) == (text, {})
    broken = "oops <tool_call>{not json}</tool_call> end"
    assert _stream_hermes(_splits(broken, seed)) == (broken, {})


def test_stream_holds_back_a_possible_tag():
    stream = HermesStream()
    assert stream.feed("hello <tool") == ("hello ", [])
    assert stream.feed("box>") == ("<toolbox>", [])


def _stream_reasoning(pieces, thinking=True, ids=()):
    parser = ReasoningStream(thinking=thinking, start_token_id=START_ID, end_token_id=END_ID)
    reasoning, content = "", ""
    for p in pieces:
        r, c = parser.feed(p)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    parser.feed("", ids)
    return reasoning + r, content + c, parser


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>\nplan</think>\n\nanswer", ("\nplan", "\n\nanswer")),
        (
            "plan (the prompt opened think)</think>answer",
            ("plan (the prompt opened think)", "answer"),
        ),  # noqa: E501
        ("<think>never closed", ("never closed", "")),
        ("no tags at all", ("no tags at all", "")),
        ("a</think>b</think>c", ("a", "bc")),
        ("<think>x <thin y</think>< /think>", ("x <thin y", "< /think>")),
    ],
)
def test_reasoning_split_in_every_chunking(text, expected, seed):
    assert _stream_reasoning(_splits(text, seed))[:2] == expected


def test_reasoning_off_returns_text_as_content():
    assert _stream_reasoning(["<think>a</think>b"], thinking=False)[:2] == ("", "<think>a</think>b")


def test_reasoning_tokens_counted_by_id_without_the_tags():
    parser = ReasoningStream(thinking=True, start_token_id=START_ID, end_token_id=END_ID)
    parser.feed("", [START_ID, 5, 6])
    parser.feed("", [7, END_ID, 8, 9, END_ID])
    assert parser.num_reasoning_tokens == 3
    opened_in_prompt = ReasoningStream(thinking=True, start_token_id=START_ID, end_token_id=END_ID)
    opened_in_prompt.feed("", [5, 6, END_ID, 7])
    assert opened_in_prompt.num_reasoning_tokens == 2
    off = ReasoningStream(thinking=False, start_token_id=START_ID, end_token_id=END_ID)
    off.feed("", [5, END_ID])
    assert off.num_reasoning_tokens == 0


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _auto_parsing(**kw) -> AnswerParsing:
    tools = tool_request(TOOLS, "auto", None, enable_auto_tool_choice=True)
    return AnswerParsing(tools=tools, auto_tool_parser="hermes", **kw)


@pytest.mark.parametrize("seed", range(20))
def test_tool_calls_are_read_from_content_only(seed):
    """A call written inside the reasoning stays reasoning text; one after it is a call."""
    inner = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    text = f"<think>maybe {inner}</think>ok " + CALL
    parsing = _auto_parsing(think_token_ids=(START_ID, END_ID))
    whole = ChoiceParser(parsing).message(text, [])
    assert whole["reasoning_content"] == f"maybe {inner}"
    assert whole["content"] == "ok "
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather"]
    assert json.loads(whole["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
    streamed = ChoiceParser(parsing)
    deltas = [streamed.feed(p, []) for p in _splits(text, seed)] + [streamed.finish()]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas if d)
    content = "".join(d.get("content", "") for d in deltas if d)
    calls = [c for d in deltas if d for c in d.get("tool_calls", [])]
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert calls[0]["function"]["name"] == "get_weather" and streamed.num_tool_calls == 1
    args = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(args) == json.loads(whole["tool_calls"][0]["function"]["arguments"])


def test_parallel_tool_calls_false_keeps_the_first_call():
    tools = tool_request(TOOLS, "auto", False, enable_auto_tool_choice=True)
    parser = ChoiceParser(AnswerParsing(tools=tools, auto_tool_parser="hermes"))
    message = parser.message(CALL + CALL2, [])
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_required_answer_streams_one_call_per_element():
    tools = tool_request(TOOLS, "required", None, enable_auto_tool_choice=False)
    answer = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_weather","parameters":{"city":"}"}}]'  # noqa: E501
    whole = ChoiceParser(AnswerParsing(tools=tools)).message(answer, [])
    assert whole["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in whole["tool_calls"]] == [
        {"city": "Oslo"},
        {"city": "}"},
    ]
    streamed = ChoiceParser(AnswerParsing(tools=tools))
    deltas = [streamed.feed(p, []) for p in _splits(answer, 3)] + [streamed.finish()]
    calls = [c for d in deltas if d for c in d["tool_calls"]]
    assert [c["index"] for c in calls] == [0, 0, 1, 1]
    assert calls[1]["function"]["arguments"] == whole["tool_calls"][0]["function"]["arguments"]
