"""POST /v1/responses over the echo engine: the chat request it becomes, the Response object and
its stream as the openai client reads them, and every refusal naming its field."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from mmserve.api.responses_output import ResponsesFormat
from mmserve.api.responses_protocol import ResponsesRequest
from mmserve.engine.frontend.outputs import CompletionOutput, RequestOutput
from mmserve.sampling_params import SamplingParams
from tests.support.echo_app import MODEL, assert_openai_error, make_app
from tests.support.echo_engine import FAIL_MARKER, IMAGE_TOKENS, EchoEngine
from tests.support.harness import data_url

pytestmark = pytest.mark.anyio
PNG = data_url(b"\x89PNG fake bytes")  # the echo engine only checks the data: prefix


@pytest.fixture
async def oai(engine: EchoEngine) -> AsyncIterator[openai.AsyncOpenAI]:
    transport = httpx.ASGITransport(app=make_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
        yield openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0
        )


def image_input(text: str) -> list[dict]:
    parts = [
        {"type": "input_text", "text": text},
        {"type": "input_image", "image_url": PNG, "detail": "low"},
    ]
    return [{"role": "user", "content": parts}]


async def test_a_response_is_the_chat_completion_of_the_same_input(
    oai: openai.AsyncOpenAI,
) -> None:
    response = await oai.responses.create(
        model=MODEL, input=image_input("look: "), instructions="sys ", max_output_tokens=12
    )
    chat = await oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "sys "},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look: "},
                    {"type": "image_url", "image_url": {"url": PNG}},
                ],
            },
        ],
        max_completion_tokens=12,
    )
    assert response.output_text == chat.choices[0].message.content == "sys look: "
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete"  # 12 tokens: the echo ran out
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "sys "
    usage = response.usage
    assert usage is not None and chat.usage is not None
    assert usage.input_tokens == chat.usage.prompt_tokens == len("sys look: ") + IMAGE_TOKENS
    assert usage.output_tokens == chat.usage.completion_tokens == 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"


async def test_sampling_fields_reach_the_engine(
    oai: openai.AsyncOpenAI, engine: EchoEngine
) -> None:
    await oai.responses.create(
        model=MODEL, input="hi", temperature=0.25, top_p=0.5, max_output_tokens=3, store=False
    )
    params = engine.sampling_params[-1]
    assert (params.temperature, params.top_p, params.max_tokens) == (0.25, 0.5, 3)
    assert params.structured_outputs is None


async def test_stream_events_parse_and_add_up_to_the_whole_answer(
    oai: openai.AsyncOpenAI,
) -> None:
    whole = await oai.responses.create(model=MODEL, input=image_input("abc"), max_output_tokens=6)
    async with oai.responses.stream(
        model=MODEL, input=image_input("abc"), max_output_tokens=6
    ) as stream:
        events = [event async for event in stream]
    # get_final_response() wants response.completed; an answer that ran out of tokens ends
    # with response.incomplete instead (OpenAI's event), whose response is the whole answer.
    final = events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens ran out, as in the whole answer
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text == "abc"
    assert final.usage is not None and whole.usage is not None
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_a_finished_answer_is_completed_unless_it_ran_out() -> None:
    body = ResponsesRequest.model_validate({"input": "x"})
    fmt = ResponsesFormat(body, MODEL, SamplingParams(max_tokens=4), "resp_1")
    done = CompletionOutput(0, "ok", [1, 2], finish_reason="stop", num_tokens=2)
    answer = fmt.response(RequestOutput("r", None, [5, 6, 7], [done], finished=True))
    assert answer["status"] == "completed" and answer["incomplete_details"] is None
    assert answer["completed_at"] is not None
    assert answer["output"][0]["status"] == "completed"
    assert answer["usage"]["total_tokens"] == 5


async def test_failure_after_the_first_event_is_reported_in_band(
    client: httpx.AsyncClient,
) -> None:
    body = {"model": MODEL, "input": FAIL_MARKER, "stream": True, "max_output_tokens": 8}
    resp = await client.post("/v1/responses", json=body)
    assert resp.status_code == 200
    events = _events(resp.text)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert "image embeddings" in events[-2]["message"]
    assert events[-1]["response"]["status"] == "failed"


def _events(text: str) -> list[dict]:
    out = []
    for block in filter(None, text.split("\n\n")):
        kind, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        out.append(payload)
    return out


async def test_text_format_asks_for_structured_output(
    oai: openai.AsyncOpenAI, engine: EchoEngine
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    response = await oai.responses.create(
        model=MODEL, input="x", max_output_tokens=2, text={"format": fmt}
    )
    spec = engine.sampling_params[-1].structured_outputs
    assert spec is not None and spec.kind == "json_schema"
    assert json.loads(spec.spec) == schema
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    await oai.responses.create(
        model=MODEL, input="x", max_output_tokens=2, text={"format": {"type": "json_object"}}
    )
    spec = engine.sampling_params[-1].structured_outputs
    assert spec is not None and spec.kind == "json_object"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"not_a_field": 1}, "not_a_field"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10_000}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": 5}}}}, None),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"model": "other"}, "model"),
    ],
)
async def test_refusals_name_the_responses_field(
    client: httpx.AsyncClient, extra: dict, param: str | None
) -> None:
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": "x", **extra})
    status = 404 if param == "model" else 400
    error = assert_openai_error(resp, status, param)
    if param is None:  # a schema the grammar compiler refuses
        assert error["param"].startswith("text.format"), error


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ([{"type": "input_file", "file_id": "f"}], "input[0].content[0].type"),
        ([{"type": "input_image", "file_id": "f"}], "input[0].content[0].file_id"),
        (
            [{"type": "input_image", "image_url": PNG, "detail": "max"}],
            "input[0].content[0].detail",
        ),
        ([{"type": "input_image", "image_url": 7}], "input[0].content[0].image_url"),
        ([{"type": "input_text", "text": 1}], "input[0].content[0].text"),
        ([{"type": "input_text", "text": "x", "extra": 1}], "input[0].content[0].extra"),
        ([{"type": "output_text", "text": "x"}], "input[0].content[0].type"),  # user's
        ({"role": "tool", "content": "x"}, "input[0].role"),
        ({"role": "user", "content": "x", "extra": 1}, "input[0].extra"),
        ({"role": "user", "content": 5}, "input[0].content"),
        ({"type": "function_call_output", "call_id": "c"}, "input[0].output"),
        ({"type": "reasoning", "summary": []}, "input[0].type"),
    ],
)
async def test_bad_input_items_are_named(client: httpx.AsyncClient, item: dict, param: str) -> None:
    if isinstance(item, list):
        item = {"role": "user", "content": item}
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": [item]})
    assert_openai_error(resp, 400, param)


async def test_history_and_informational_fields_are_accepted(
    client: httpx.AsyncClient, engine: EchoEngine
) -> None:
    history = [
        {"role": "user", "content": "q"},
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "a", "annotations": []}],
        },
        {"role": "developer", "content": [{"type": "input_text", "text": "d"}]},
    ]
    body = {
        "model": MODEL,
        "input": history,
        "max_output_tokens": 3,
        "metadata": {"k": "v"},
        "user": "u",
        "store": False,
        "truncation": "disabled",
        "service_tier": "auto",
    }
    resp = await client.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["metadata"] == {"k": "v"} and answer["store"] is False
    assert answer["output"][0]["content"][0]["text"] == "qad"


async def test_media_errors_point_at_input(client: httpx.AsyncClient) -> None:
    item = {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}
    resp = await client.post("/v1/responses", json={"model": MODEL, "input": [item]})
    assert_openai_error(resp, 400, "input")
