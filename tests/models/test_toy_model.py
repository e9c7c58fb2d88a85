"""The bundled toy model, served by mmserve's offline API, really answers about the pictures,
exactly as transformers does with the same weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config.model import bundled_toy_model_dir
from tests.support.oracle import HFOracle
from tests.support.toy_examples import EXTRA_TASKS, TASKS, accuracy_target, held_out

GREEDY = SamplingParams(temperature=0, max_tokens=12)
NUM_PER_TASK = 100
# The targets (>= 97% one-image, >= 90% two-image). Where the committed checkpoint falls
# short of one (its model card says which), the test below holds mmserve to what transformers
# measured for these weights instead: that is the engine's part of the bargain.
# count and nth_colour are questions of our own, with no target.
TARGETS = {task: accuracy_target(task) for task in TASKS if task not in EXTRA_TASKS}


def _card() -> dict:
    return json.loads((Path(bundled_toy_model_dir()) / "accuracy.json").read_text())


@pytest.fixture(scope="module")
def toy() -> LLM:
    return LLM()  # no model: the bundled toy checkpoint


def _accuracy(llm: LLM, task: str, num: int) -> float:
    questions = held_out(task, num)
    outs = llm.chat([q.messages() for q in questions], GREEDY, use_tqdm=False)
    right = sum(o.outputs[0].text.strip() == q.answer for o, q in zip(outs, questions, strict=True))
    return right / num


def test_llm_with_no_model_loads_the_toy(toy):
    assert Path(toy.engine_config.checkpoint.model) == Path(bundled_toy_model_dir())
    assert toy.get_tokenizer().token_to_id("<|image_pad|>") is not None


@pytest.mark.parametrize("task", TASKS)
def test_accuracy_through_mmserve_matches_the_model_card(toy, task):
    """mmserve answers fresh held-out questions as well as transformers did for these weights
    (or reaches the issue's target), within three standard errors of the two samples."""
    card = _card()
    p = card["accuracy"][task]
    stderr = math.sqrt(p * (1 - p) * (1 / NUM_PER_TASK + 1 / card["num_per_task"]))
    expected = min(TARGETS.get(task, 1.0), p - max(0.03, 3 * stderr))
    assert _accuracy(toy, task, NUM_PER_TASK) >= expected


def test_colour_the_cache_oracle_meets_the_target(toy):
    """The cache tests tell pictures apart by colour: that answer must be reliable."""
    assert _accuracy(toy, "colour", NUM_PER_TASK) >= TARGETS["colour"]


@pytest.mark.parametrize(
    "num_prompts", [60, pytest.param(200, marks=pytest.mark.slow)], ids=lambda n: f"{n}_prompts"
)
def test_greedy_answers_equal_transformers_on_held_out_prompts(toy, num_prompts):
    """Every task in both runs (60 in the default run, every task's 200 with -m slow)."""
    oracle = HFOracle(bundled_toy_model_dir())
    tokenizer = toy.get_tokenizer()
    per_task = num_prompts // len(TASKS) + 1
    questions = [q for task in TASKS for q in held_out(task, per_task, seed=7)][:num_prompts]
    outs = toy.chat([q.messages() for q in questions], GREEDY, use_tqdm=False)
    im_end = tokenizer.token_to_id("<|im_end|>")
    for q, out in zip(questions, outs, strict=True):
        prompt = tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        prompt = _collapse_image_pads(prompt)
        expected = _until(oracle.greedy(prompt, list(q.images), GREEDY.max_tokens), im_end)
        assert out.outputs[0].token_ids == expected, (q.task, q.question)


def _until(tokens: list[int], stop: int) -> list[int]:
    return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens


def _collapse_image_pads(prompt: str) -> str:
    """mmserve's expanded prompt back to one <|image_pad|> per image (the oracle expands it)."""
    pad = "<|image_pad|>"
    while pad + pad in prompt:
        prompt = prompt.replace(pad + pad, pad)
    return prompt


@pytest.mark.parametrize(
    ("picture", "question", "answer"),
    [
        ("red_circle.png", "What is in the image?", "a red circle"),
        ("red_circle.png", "What colour is the shape?", "red"),
        ("blue_square.png", "Where is the shape?", "top right"),
    ],
)
def test_the_readme_first_run_answers(toy, picture, question, answer):
    """The project README promises these answers for the pictures in docs/examples."""
    from PIL import Image

    path = Path(__file__).resolve().parents[2] / "docs" / "examples" / picture
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": Image.open(path)},
                {"type": "text", "text": question},
            ],
        }
    ]
    assert toy.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].text.strip() == answer
