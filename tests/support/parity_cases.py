"""Prompts and pictures the parity tests share, and the init that makes tiny answers differ."""

from __future__ import annotations

from tests.support.factory import random_image

# With transformers' default init (std 0.02) a tiny random model repeats one token whatever
# the image; std 0.15 makes greedy output depend on every input, so parity tests can fail.
DIVERSE = {"text": {"initializer_range": 0.15}, "vision": {"initializer_range": 0.15}}


IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def chat(text: str) -> str:
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


CASES = {
    "text_only": (chat("Describe a red circle."), []),
    "one_image": (chat(f"{IMG}What is in the image?"), [random_image(56, 84, seed=1)]),
    "two_images": (
        chat(f"{IMG}First this one, then{IMG} this one. Same?"),
        [random_image(112, 60, seed=2), random_image(70, 140, seed=3)],
    ),
}


def _request(prompt: str, images: list) -> dict | str:
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
