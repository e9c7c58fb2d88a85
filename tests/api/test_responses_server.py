"""The Responses API and /tokenize, /detokenize on a real `mmserve serve` (the bundled toy model,
which answers its shape questions and stops), driven by the `openai` client."""

from __future__ import annotations

import io
import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from mmserve.config.model import bundled_toy_model_dir
from tests.api.hostile import example, healthy, png_data_url
from tests.support.grammar import SCHEMA
from tests.support.harness import Server, data_url, wait_until_idle
from tests.support.toy_examples import ToyQuestion, held_out

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(bundled_toy_model_dir(), tmp_path_factory.mktemp("responses") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def question() -> ToyQuestion:
    return held_out("shape", 1)[0]


def _png(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return data_url(buf.getvalue())


def chat_messages(q: ToyQuestion) -> list[dict]:
    return q.messages([{"type": "image_url", "image_url": {"url": _png(q.images[0])}}])


def responses_input(q: ToyQuestion) -> tuple[str | None, list[dict]]:
    """(instructions, input): the same conversation in the Responses API's shapes."""
    parts = [{"type": "input_image", "image_url": _png(img), "detail": "auto"} for img in q.images]
    parts.append({"type": "input_text", "text": q.question})
    return q.system, [{"role": "user", "content": parts}]


def create(server: Server, q: ToyQuestion, **extra):
    instructions, given = responses_input(q)
    if instructions is not None:
        extra["instructions"] = instructions
    return server.client.responses.create(
        model=model_of(server), input=given, max_output_tokens=MAX_TOKENS, temperature=0, **extra
    )


def model_of(server: Server) -> str:
    return server.client.models.list().data[0].id


def test_a_response_with_an_image_is_the_greedy_chat_answer(server, question) -> None:
    response = create(server, question)
    chat = server.client.chat.completions.create(
        model=server.client.models.list().data[0].id,
        messages=chat_messages(question),
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.output_text  # the toy model answers its questions
    assert response.status == "completed"  # it stopped on its own, like the chat did
    assert chat.choices[0].finish_reason == "stop"
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


def test_streamed_events_add_up_to_the_whole_answer(server, question) -> None:
    whole = create(server, question)
    instructions, given = responses_input(question)
    with server.client.responses.stream(
        model=model_of(server),
        input=given,
        instructions=instructions,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.total_tokens == whole.usage.total_tokens


def test_json_schema_output_validates(server) -> None:
    for q in held_out("shape", 3):
        fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
        response = create(server, q, text={"format": fmt})
        jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_stateful_fields_are_refused_by_name(server) -> None:
    for extra in ({"store": True}, {"previous_response_id": "resp_123"}):
        with pytest.raises(openai.BadRequestError) as info:
            server.client.responses.create(model=model_of(server), input="hi", **extra)
        assert info.value.body["param"] == next(iter(extra))  # type: ignore[index]
    answer = server.client.responses.create(
        model=model_of(server), input="hi", store=False, max_output_tokens=2
    )
    assert answer.output


def test_tokenize_counts_what_chat_and_completions_report(server, question) -> None:
    model = server.client.models.list().data[0].id
    messages = chat_messages(question)
    body = {"model": model, "messages": messages, "return_token_strs": True}
    counted = httpx.post(f"{server.url}/tokenize", json=body)
    assert counted.status_code == 200, counted.text
    chat = server.client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert chat.usage is not None
    assert counted.json()["count"] == chat.usage.prompt_tokens
    assert counted.json()["token_strs"].count("<|image_pad|>") > 1  # the image's placeholders
    assert counted.json()["max_model_len"] == server.client.models.list().data[0].max_model_len

    prompt = "A plain prompt, with no image at all."
    counted = httpx.post(f"{server.url}/tokenize", json={"model": model, "prompt": prompt})
    completion = server.client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert completion.usage is not None
    assert counted.json()["count"] == completion.usage.prompt_tokens


def test_detokenize_round_trips_tokenize(server) -> None:
    text = "<|im_start|>user\nDraw 3 stars, café ☆<|im_end|>"
    body = {"prompt": text, "return_token_strs": True}
    tokens = httpx.post(f"{server.url}/tokenize", json=body).json()
    assert len(tokens["token_strs"]) == tokens["count"] == len(tokens["tokens"])
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": text}
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.0"


def test_tokenize_continues_the_final_message(server) -> None:
    messages = [
        {"role": "user", "content": "Which shape?"},
        {"role": "assistant", "content": "It is a"},
    ]
    body = {"messages": messages, "add_generation_prompt": False, "return_token_strs": True}
    closed = httpx.post(f"{server.url}/tokenize", json=body).json()
    opened = httpx.post(
        f"{server.url}/tokenize", json={**body, "continue_final_message": True}
    ).json()
    assert opened["tokens"] == closed["tokens"][: opened["count"]]
    assert "<|im_end|>" in closed["token_strs"][opened["count"] :]
    both = httpx.post(
        f"{server.url}/tokenize",
        json={**body, "add_generation_prompt": True, "continue_final_message": True},
    )
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"


def test_errors_from_the_chat_path_name_the_input_item(server) -> None:
    given = [{"role": "user", "content": [{"type": "input_text", "text": "<|image_pad|>"}]}]
    with pytest.raises(openai.BadRequestError) as info:
        server.client.responses.create(model=model_of(server), input=given, instructions="Be.")
    body = info.value.body
    assert body["param"] == "input"  # type: ignore[index]
    assert "input[0]" in body["message"] and "messages" not in body["message"]  # type: ignore[index]


RESPONSES_FIELDS = [
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
    "text", "tools", "tool_choice", "store", "previous_response_id", "metadata", "background",
    "include", "truncation", "top_logprobs", "reasoning", "stream_options", "top_k", "seed",
    "mm_processor_kwargs", "cache_salt", "user",
]  # fmt: skip
INPUT_PATHS = [
    ("input", 0), ("input", 0, "role"), ("input", 0, "type"), ("input", 0, "content"),
    ("input", 0, "content", 0), ("input", 0, "content", 0, "type"),
    ("input", 0, "content", 0, "image_url"), ("input", 0, "content", 0, "detail"),
    ("input", 0, "content", 1, "text"), ("text", "format"), ("text", "format", "type"),
    ("text", "format", "schema"),
]  # fmt: skip
TOKENIZE_FIELDS = [
    "prompt", "messages", "add_special_tokens", "add_generation_prompt",
    "continue_final_message", "return_token_strs", "chat_template_kwargs", "tokens",
]  # fmt: skip
POOL: list[Any] = [
    None, True, False, 0, -1, 1, 2**63, 1e308, 0.5, "", "x", "<|image_pad|>", "\u0000",
    "data:image/png;base64,!!", "http://127.0.0.1:1/x.png", "input_image", "json_schema",
    [], [1, -1], [{"type": "input_text"}], {}, {"type": "json_schema"}, {"a": [None]},
]  # fmt: skip


def _set(body: dict, path: tuple, value: Any) -> None:
    node: Any = body
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return  # an earlier mutation replaced this branch
    if isinstance(node, dict) or (isinstance(node, list) and path[-1] < len(node)):
        node[path[-1]] = value


def _fuzz_cases(rng: random.Random, image: str) -> list[tuple[str, dict]]:
    cases = []
    for _ in range(96):
        if rng.random() < 0.7:
            path = "/v1/responses"
            parts = [
                {"type": "input_image", "image_url": image},
                {"type": "input_text", "text": "What is in the image?"},
            ]
            body: dict = {
                "input": [{"role": "user", "content": parts}],
                "max_output_tokens": 4,
                "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}},
            }
            fields: list[tuple] = [(f,) for f in RESPONSES_FIELDS] + INPUT_PATHS
        else:
            path = rng.choice(["/tokenize", "/detokenize"])
            body = {"prompt": "a red"} if path == "/tokenize" else {"tokens": [1, 2]}
            fields = [(f,) for f in TOKENIZE_FIELDS]
        for field in rng.sample(fields, rng.randint(1, 3)):
            _set(body, field, rng.choice(POOL))
        cases.append((path, body))
    return cases


def test_fuzzed_fields_never_give_a_5xx(server) -> None:
    image = png_data_url(example("red_circle"))
    cases = _fuzz_cases(random.Random(20261203), image)

    def send(case: tuple[str, dict]) -> tuple[int, str]:
        resp = httpx.post(server.url + case[0], json=case[1], timeout=120)
        return resp.status_code, resp.text

    statuses: dict[int, int] = {}
    with ThreadPoolExecutor(4) as pool:
        for case, (status, answer) in zip(cases, pool.map(send, cases), strict=True):
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, (case, status, answer[:300])
            assert '"code": "internal_error"' not in answer, (case, answer[:300])
    assert healthy(server)
    # the fuzzer also exercised real generation, and many refusals
    assert statuses.get(200, 0) >= 3 and sum(statuses.values()) - statuses[200] >= 30, statuses
    wait_until_idle(server.url, timeout_s=60)
