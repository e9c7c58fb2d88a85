"""`mmserve serve` on a Qwen3-VL checkpoint starts and answers through the openai client, as
the offline engine does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from tests.support.factory import png_bytes
from tests.support.harness import Server, data_url, image_part, user


@pytest.fixture(scope="module")
def server(qwen3_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = Server(qwen3_vl_dir, log, "--limit-mm-per-prompt", '{"image": 2}')
    yield srv
    srv.stop()


def test_chat_with_two_images_equals_offline_greedy(server: Server, qwen3_vl_dir: Path) -> None:
    messages = user(
        image_part(data_url(png_bytes(96, 64, seed=1))),
        "and",
        image_part(data_url(png_bytes(40, 200, seed=2))),
        "Which is taller?",
    )
    with LLM(model=str(qwen3_vl_dir)) as llm:
        offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
    model = server.client.models.list().data[0].id
    resp = server.client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=8
    )
    assert resp.choices[0].message.content == offline.outputs[0].text
    assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)
    # 96x64 -> 3x2 merged tokens, 40x200 -> 1x6 (patch 16, merge 2)
    image_token_id = json.loads((qwen3_vl_dir / "config.json").read_text())["image_token_id"]
    assert offline.prompt_token_ids.count(image_token_id) == 6 + 6
