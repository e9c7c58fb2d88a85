"""The bundled toy model behind a real server: every cache on, and the answers stay right.

The toy model's answers change with the picture, so a cache that served the wrong entry
(another image's KV blocks or embeddings, another tenant's UUID) shows up as a wrong answer.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image
from scripts.toy_data import COLOURS, Picture, Shape, draw

from mmserve.config.model import bundled_toy_model_dir
from tests.support.harness import Server, data_url, read_metrics, wait_until_idle
from tests.support.toy_examples import held_out

LONG_SYSTEM = (
    "you are a helpful assistant that answers questions about pictures briefly and exactly "
    "please look at the image carefully then reply with a few words only "
) * 3


def _png(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return data_url(buf.getvalue())


def _circle(colour: str, size: int = 168) -> Image.Image:
    """The same circle in the same place on the same background; only its colour changes."""
    shape = Shape("circle", colour, COLOURS[colour], size * 0.5, size * 0.5, size * 0.35)
    return draw(Picture(size, size, (128, 128, 128), (shape,)))


def _ask(server: Server, image_part: dict, question: str, system: str | None = None, **extra):
    return _ask_parts(server, [image_part], question, system, **extra)


def _ask_parts(server: Server, parts: list[dict], question: str, system: str | None, **extra):
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    resp = server.client.chat.completions.create(
        model="mmserve-toy", messages=messages, max_tokens=12, temperature=0, extra_body=extra
    )
    return resp.choices[0].message.content.strip()


def _url_part(image: Image.Image) -> dict:
    return {"type": "image_url", "image_url": {"url": _png(image)}}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = Server(bundled_toy_model_dir(), tmp_path_factory.mktemp("toy") / "server.log")
    yield srv
    srv.stop()


def test_shared_long_prefix_different_colours_same_size(server):
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "red", "blue"]
    for colour in colours:
        part = _url_part(_circle(colour))
        assert _ask(server, part, "What colour is the shape?", LONG_SYSTEM) == colour
        # "a <colour> <shape>": the colour word is the part that differs between the pictures
        assert _ask(server, part, "What is in the image?", LONG_SYSTEM).split()[1] == colour
    metrics = read_metrics(server.url)
    assert metrics["mmserve_prefix_cache_hits_total"] > 0  # the long prefix really was shared
    wait_until_idle(server.url)


def test_same_picture_after_a_one_token_longer_prefix(server):
    part = _url_part(_circle("purple"))
    assert _ask(server, part, "What colour is the shape?", "Be brief.") == "purple"
    assert _ask(server, part, "What colour is the shape?", "Be very brief.") == "purple"
    green = _url_part(_circle("green"))
    assert _ask(server, green, "What colour is the shape?", "Be very brief.") == "green"


def test_shrinking_max_pixels_keeps_answers_right(server):
    # The smallest the toy's image processor allows: every picture down to min_pixels.
    config = Path(bundled_toy_model_dir()) / "preprocessor_config.json"
    min_pixels = json.loads(config.read_text())["min_pixels"]
    for colour in ("orange", "blue"):
        part = _url_part(_circle(colour, size=336))
        assert _ask(server, part, "What colour is the shape?") == colour
        small = {"mm_processor_kwargs": {"max_pixels": min_pixels}}
        assert _ask(server, part, "What colour is the shape?", **small) == colour


def test_held_out_questions_through_the_server(server):
    # nth_colour asks about one of two pictures of different colours: a cache that swapped the
    # pictures' embeddings or KV blocks would answer with the other picture's colour.
    for q in held_out("colour", 10, seed=99) + held_out("nth_colour", 10, seed=99):
        parts = [_url_part(image) for image in q.images]
        assert _ask_parts(server, parts, q.question, q.system) == q.answer


@pytest.fixture(scope="module")
def tenants(tmp_path_factory) -> Iterator[Server]:
    srv = Server(
        bundled_toy_model_dir(),
        tmp_path_factory.mktemp("tenants") / "server.log",
        "--api-key", "key-alice", "key-bob",
    )  # fmt: skip
    yield srv
    srv.stop()


def test_caller_uuids_never_cross_api_key_namespaces(tenants):
    import openai

    alice = openai.OpenAI(base_url=f"{tenants.url}/v1", api_key="key-alice", max_retries=0)
    bob = openai.OpenAI(base_url=f"{tenants.url}/v1", api_key="key-bob", max_retries=0)

    def ask(client, image_url: dict) -> str:
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": image_url},
                    {"type": "text", "text": "What colour is the shape?"},
                ],
            }
        ]
        resp = client.chat.completions.create(
            model="mmserve-toy", messages=messages, max_tokens=12, temperature=0
        )
        return resp.choices[0].message.content.strip()

    # Both tenants name their picture "logo"; the pictures differ.
    assert ask(alice, {"url": _png(_circle("red")), "uuid": "logo"}) == "red"
    assert ask(bob, {"url": _png(_circle("blue")), "uuid": "logo"}) == "blue"
    # By UUID alone each tenant gets its own picture back.
    assert ask(alice, {"uuid": "logo"}) == "red"
    assert ask(bob, {"uuid": "logo"}) == "blue"
    # A tenant cannot reach a UUID only the other one used.
    assert ask(alice, {"url": _png(_circle("green")), "uuid": "alice-only"}) == "green"
    with pytest.raises(openai.BadRequestError) as err:
        ask(bob, {"uuid": "alice-only"})
    assert "uuid" in str(err.value).lower()


@pytest.fixture(scope="module")
def cramped(tmp_path_factory) -> Iterator[Server]:
    srv = Server(
        bundled_toy_model_dir(),
        tmp_path_factory.mktemp("cramped") / "server.log",
        "--max-num-batched-tokens", "32",
        "--encoder-cache-size", "1",  # floored at one item: every new picture evicts the last
    )  # fmt: skip
    yield srv
    srv.stop()


def test_chunked_prefill_and_tiny_encoder_cache_give_the_same_answers(server, cramped):
    questions = held_out("describe", 6, seed=5) + held_out("position", 6, seed=5)
    for q in questions:
        (image,) = q.images
        part = _url_part(image)
        reference = _ask(server, part, q.question, q.system)
        assert _ask(cramped, part, q.question, q.system) == reference
    metrics = read_metrics(cramped.url)
    # the pictures really were evicted and re-encoded on the cramped server
    assert metrics['mmserve_encoder_items_encoded_total{modality="image"}'] >= len(questions)
    wait_until_idle(cramped.url)
