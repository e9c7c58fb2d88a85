"""The Triton backend compiled for CUDA against the torch backend, at real model shapes."""

from __future__ import annotations

import random

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.layers.attention import write_kv_cache
from tests.layers.triton_cases import make_batch, reference, run_backend
from tests.support.factory import random_image

triton = pytest.importorskip("triton")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        bool(triton.knobs.runtime.interpret), reason="TRITON_INTERPRET=1 is set: not compiled"
    ),
]

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def backend():
    from mmserve.layers.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _serving_batch(rng: random.Random) -> list[tuple[int, int]]:
    """64 decodes over long contexts, a chunk on a long context, a fresh prefill, odd sizes."""
    decodes = [(rng.randint(1, 4000), 1) for _ in range(64)]
    return [*decodes, (1000, 512), (0, 2048), (17, 33), (0, 1)]


# (num_heads, num_kv_heads, head_dim, block_size, dtype): Qwen2-VL-7B, -2B, Qwen3-VL-8B, head
# dims of 80, 72 and 24 (not powers of two: masked tails)
SHAPES = [
    (28, 4, 128, 16, torch.bfloat16),
    (32, 8, 128, 16, torch.bfloat16),
    (16, 4, 72, 16, torch.bfloat16),
    (4, 2, 24, 32, torch.bfloat16),
    (12, 2, 128, 16, torch.bfloat16),
    (32, 8, 80, 32, torch.bfloat16),
    (28, 4, 128, 32, torch.float16),
    (16, 4, 64, 16, torch.float32),
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size", "dtype"), SHAPES)
def test_paged_attention_on_cuda_matches_the_torch_backend(
    backend, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
) -> None:
    batch = make_batch(
        _serving_batch(random.Random(head_dim)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
    )
    want, want_cache = reference(batch)
    got, got_cache = run_backend(backend, batch)
    assert torch.equal(got_cache, want_cache)
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


def test_kv_store_on_cuda_matches_write_kv_cache(backend) -> None:
    from mmserve.layers.attention.triton_backend import store_kv

    slots = torch.randperm(4096 * 16, device="cuda")[:3000]
    key, value = torch.randn(2, 3000, 4, 128, device="cuda", dtype=torch.bfloat16)
    want = torch.zeros(2, 4096, 16, 4, 128, device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    write_kv_cache(want, key, value, slots)
    store_kv(backend, got, key, value, slots)
    assert torch.equal(got, want)


def test_engine_on_cuda_is_greedy_identical_across_backends(qwen2_5_vl_dir) -> None:
    """float32 (exact dot products on both paths), so greedy ties cannot tip either way."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [
        {
            "prompt": "<|vision_start|><|image_pad|><|vision_end|>What is it?",
            "multi_modal_data": {"image": random_image(112, 84, 4)},
        },
        "Describe a red circle.",
    ]
    answers = []
    for name in ("torch", "triton"):
        with LLM(
            model=str(qwen2_5_vl_dir),
            device="cuda",
            dtype="float32",
            attention_backend=name,
            max_num_batched_tokens=64,
        ) as llm:
            assert llm.config.attention_backend == name
            answers.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert answers[0] == answers[1]
