"""Qwen3-VL videos end to end against transformers (float32, tiny random checkpoint): the
prompt ids, greedy tokens and top-k logprobs (1e-4) of a timestamped video, given as frames
through the offline LLM API (whole and with chunked prefill cutting through its temporal
groups) and as a file through `mmserve serve`.

transformers builds its side alone: Qwen3VLProcessor (timestamps, pixels, mm_token_type_ids)
and the model's own forward (get_rope_index, DeepStack), so this checks mmserve's processing
and model together.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.models.registry import MODEL_REGISTRY
from tests.support.factory import video_bytes, video_frames, write_tiny_checkpoint
from tests.support.harness import Server, data_url
from tests.support.qwen3_processing import hf_qwen3_processor, write_qwen3_checkpoint

QWEN3_VL = "Qwen3VLForConditionalGeneration"
pytestmark = pytest.mark.skipif(
    QWEN3_VL not in MODEL_REGISTRY,
    reason="mmserve has no Qwen3-VL model class in this build (it comes with branch q3-model)",
)

NUM_TOKENS = 6
NUM_TOP = 5
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
# 4 frames of 160x128 stay 160x128 under the clip budget: 2 groups of 8x10 patches, 20
# embeddings each, so 16-token chunks cut through a group.
FRAMES = video_frames(4, 160, 128, seed=11)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_vl_ckpt"))


def _hf_model(checkpoint: Path):
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, like ignore_eos
    return model.eval()


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path):
    return _hf_model(checkpoint)


def _prompt(checkpoint: Path) -> str:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Why?"}]}]
    tok = AutoTokenizer.from_pretrained(checkpoint)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _hf_inputs(checkpoint: Path, prompt: str, frames: np.ndarray, fps: float, **kwargs) -> dict:
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf_qwen3_processor(checkpoint)(
            text=[prompt],
            videos=[frames],
            video_metadata=[meta],
            do_sample_frames="frames_indices" not in kwargs,
            return_tensors="pt",
        )
    return dict(out)


@torch.no_grad()
def _reference(hf_model, inputs: dict) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and its log-softmax [NUM_TOKENS, vocab] at each of them."""
    n = inputs["input_ids"].shape[1]
    generated = hf_model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False)[0, n:]
    ids = torch.cat([inputs["input_ids"], generated[None]], dim=1)
    full = dict(inputs)
    full.update(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(generated)[None]], dim=1
        ),
    )
    logits = hf_model(**full).logits[0, n - 1 : n - 1 + NUM_TOKENS]
    return generated.tolist(), torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize(
    "engine_args", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked_16"]
)
def test_frames_through_llm_match_transformers(checkpoint, hf_model, engine_args) -> None:
    prompt = _prompt(checkpoint)
    inputs = _hf_inputs(checkpoint, prompt, FRAMES, 2.0, frames_indices=[0, 1, 2, 3])
    expected, reference = _reference(hf_model, inputs)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=NUM_TOP)
    with LLM(model=str(checkpoint), **engine_args) as llm:
        (out,) = llm.generate(
            [{"prompt": prompt, "multi_modal_data": {"video": FRAMES}}], params, use_tqdm=False
        )
    assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()
    seq = out.outputs[0]
    assert list(seq.token_ids) == expected
    for step, entry in enumerate(seq.logprobs):
        top = torch.topk(reference[step], NUM_TOP).indices.tolist()
        assert set(top) <= set(entry)
        for token_id, lp in entry.items():
            assert abs(lp.logprob - float(reference[step, token_id])) < 1e-4, (step, token_id)


def test_a_video_file_through_serve_matches_transformers(
    checkpoint, hf_model, tmp_path: Path
) -> None:
    """A file (data: URL): its decoded frames' real times in the prompt, 16-token chunks."""
    import av

    raw = video_bytes(12, 160, 128, fps=6, seed=12)
    with av.open(io.BytesIO(raw)) as container:
        every = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    prompt = _prompt(checkpoint)
    inputs = _hf_inputs(checkpoint, prompt, every, 6.0)
    expected, reference = _reference(hf_model, inputs)
    server = Server(checkpoint, tmp_path / "serve.log", "--max-num-batched-tokens", "16")
    try:
        body = {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": data_url(raw, "video/mp4")}},
                        {"type": "text", "text": "Why?"},
                    ],
                }
            ],
            "max_tokens": NUM_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": NUM_TOP,
        }
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    finally:
        server.stop()
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    steps = answer["choices"][0]["logprobs"]["content"]
    assert len(steps) == NUM_TOKENS
    for step, (entry, token_id) in enumerate(zip(steps, expected, strict=True)):
        assert abs(entry["logprob"] - float(reference[step, token_id])) < 1e-4, step
        ours = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)
        ref = torch.topk(reference[step], NUM_TOP).values.tolist()
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_odd_shapes_and_no_video_file_match_transformers(tmp_path: Path) -> None:
    """The shared builder's Qwen3-VL (head_dim 24, three DeepStack levels, tied embeddings) with
    no video_preprocessor_config.json: both sides take Qwen3VLVideoProcessor's defaults (here
    the clip floor scales the frames up); 16-token chunks."""
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", arch="qwen3_vl")
    assert not (checkpoint / "video_preprocessor_config.json").exists()
    prompt = _prompt(checkpoint)
    inputs = _hf_inputs(checkpoint, prompt, FRAMES, 2.0, frames_indices=[0, 1, 2, 3])
    expected, reference = _reference(_hf_model(checkpoint), inputs)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=NUM_TOP)
    with LLM(model=str(checkpoint), max_num_batched_tokens=16) as llm:
        (out,) = llm.generate(
            [{"prompt": prompt, "multi_modal_data": {"video": FRAMES}}], params, use_tqdm=False
        )
    assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == expected
    for step, entry in enumerate(out.outputs[0].logprobs):
        for token_id, lp in entry.items():
            assert abs(lp.logprob - float(reference[step, token_id])) < 1e-4, (step, token_id)
