"""A model whose head dims are not powers of two, end to end: language-model heads of 24 and
vision heads of 72 (Qwen3-VL's) answer as transformers does on the torch path, and identically
on the Triton path (interpreted on the CPU) with decode graphs captured; a head dim the Triton
kernels cannot take stops start-up before the weights load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.execution.graphs.capture import eager_graph_factory
from tests.support.factory import random_image, write_tiny_checkpoint
from tests.support.oracle import HFOracle
from tests.support.parity_cases import DIVERSE

triton = pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(
    not triton.knobs.runtime.interpret, reason="needs TRITON_INTERPRET=1 (tests/conftest.py)"
)

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [
    (f"{IMG}What is in the image?", [random_image(56, 84, 1)]),
    ("Describe a red circle.", []),
    (f"{IMG} and {IMG}: same?", [random_image(84, 56, 2), random_image(56, 56, 3)]),
]
NUM_TOKENS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
# LM: 96 / 4 heads = 24 (mrope 4 + 4 + 4 = 12 = 24 / 2); ViT: 144 / 2 heads = 72
ODD_HEADS = {
    "text": {
        **DIVERSE["text"],
        "hidden_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 4, 4]},
    },
    "vision": {**DIVERSE["vision"], "embed_dim": 144, "num_heads": 2, "hidden_size": 96},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("odd_heads"), "qwen2_vl", seed=7, **ODD_HEADS
    )


def _requests() -> list[dict | str]:
    return [
        {"prompt": p, "multi_modal_data": {"image": images}} if images else p
        for p, images in PROMPTS
    ]


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(_requests(), GREEDY)]


def test_the_checkpoint_has_the_head_dims_it_claims(checkpoint: Path) -> None:
    from mmserve.models.config import load_model_config

    config = load_model_config(checkpoint)
    assert (config.text.head_dim, config.vision.head_dim) == (24, 72)


def test_the_torch_path_answers_as_transformers(checkpoint: Path) -> None:
    oracle = HFOracle(checkpoint)
    want = [oracle.greedy(p, images, NUM_TOKENS) for p, images in PROMPTS]
    with LLM(model=str(checkpoint), attention_backend="torch") as llm:
        assert _greedy(llm) == want


@needs_interpreter
def test_the_triton_path_with_decode_graphs_answers_as_the_torch_path(checkpoint: Path) -> None:
    with LLM(model=str(checkpoint), attention_backend="torch") as llm:
        want = _greedy(llm)
    args = dict(attention_backend="triton", max_num_batched_tokens=32, enable_prefix_caching=False)
    with LLM(model=str(checkpoint), **args) as llm:
        assert (llm.config.attention_backend, llm.config.layer_ops) == ("triton", "triton")
        assert _greedy(llm) == want
        llm.engine.core.executor.runner.capture_decode_graphs((1, 2, 4), eager_graph_factory)
        assert _greedy(llm) == want


@needs_interpreter
def test_a_head_dim_the_kernels_cannot_take_stops_start_up(
    qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    wide = tmp_path / "wide_heads"
    shutil.copytree(qwen2_vl_dir, wide)
    config = json.loads((wide / "config.json").read_text())
    config["text_config"]["head_dim"] = 264
    config["text_config"]["rope_parameters"]["mrope_section"] = [44, 44, 44]
    (wide / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="head_dim 264: the triton attention backend"):
        LLM(model=str(wide), attention_backend="triton")
