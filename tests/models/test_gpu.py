"""CUDA checks: bfloat16 on the GPU agrees with float32 on the CPU; a 4K image fits in memory.

The CPU float32 path is the one checked against transformers; here the same weights run on
CUDA in bfloat16 and must agree within bfloat16 error. Skipped without CUDA.
"""

from __future__ import annotations

import time

import pytest
import torch

from mmserve.layers.attention import TorchAttentionBackend
from mmserve.models.config import QWEN2_5_VL, QWEN2_VL, ModelConfig, TextConfig, VisionConfig
from mmserve.models.kv_cache import allocate_kv_caches
from mmserve.models.qwen2_vl_vision import VisionTransformer
from mmserve.models.registry import get_model_class
from mmserve.processing.mrope import decode_positions, get_mrope_positions
from tests.support.paged_attention import check_paged_equals_dense

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _vision(arch: str, **sizes: int) -> VisionConfig:
    if arch == QWEN2_VL:
        return VisionConfig(
            model_type="qwen2_vl", depth=sizes.get("depth", 2), embed_dim=sizes.get("dim", 64),
            num_heads=sizes.get("heads", 4), mlp_hidden_dim=4 * sizes.get("dim", 64),
            out_dim=sizes.get("out", 128),
        )  # fmt: skip
    return VisionConfig(
        model_type="qwen2_5_vl", depth=sizes.get("depth", 4), embed_dim=sizes.get("dim", 64),
        num_heads=sizes.get("heads", 4), mlp_hidden_dim=sizes.get("mlp", 128),
        out_dim=sizes.get("out", 128), hidden_act="silu", window_size=112,
        fullatt_block_indexes=(1, 3), tokens_per_second=2,
    )  # fmt: skip


def _model_config(arch: str) -> ModelConfig:
    text = TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=1e6, mrope_section=(4, 6, 6),
    )  # fmt: skip
    return ModelConfig(
        architecture=arch, text=text, vision=_vision(arch), image_token_id=500,
        video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
        eos_token_ids=(504,),
    )  # fmt: skip


def _randomise(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
            if p.dim() == 1 and p.shape[0] > 1:
                p.add_(1.0)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("arch", [QWEN2_VL, QWEN2_5_VL])
def test_model_bf16_cuda_matches_cpu_fp32(arch: str) -> None:
    config = _model_config(arch)
    cpu = get_model_class(arch)(config)
    _randomise(cpu)
    gpu = get_model_class(arch)(config).to("cuda", torch.bfloat16)
    gpu.load_state_dict(cpu.state_dict())
    grids = [(1, 8, 12), (1, 20, 28), (2, 8, 8)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), config.vision.patch_input_dim)
    with torch.inference_mode():
        ref = cpu.embed_multimodal(pixels, grids)
        out = gpu.embed_multimodal(pixels.cuda(), grids)
    for a, b in zip(out, ref, strict=True):
        assert a.device.type == "cuda" and a.dtype == torch.bfloat16
        assert _rel_err(a, b) < 3e-2
    # An LM prefill over the first image (in two chunks) then three decode steps.
    n_img = 8 * 12 // 4
    ids = [1, 2, 3, 502] + [500] * n_img + [503, 4, 5]
    positions, delta = get_mrope_positions(
        ids, grids[:1], image_token_id=500, video_token_id=501, spatial_merge_size=2
    )
    logits = {}
    for name, model, device in (("cpu", cpu, "cpu"), ("gpu", gpu, "cuda")):
        dtype = next(model.parameters()).dtype
        kv = allocate_kv_caches(config, 16, 4, device, dtype)
        table = list(range(15, 0, -1))
        with torch.inference_mode():
            mm = model.embed_multimodal(pixels[: 8 * 12].to(device), grids[:1])[0]
            embeds = model.embed_input_ids(torch.tensor(ids, device=device), mm)
            steps = []
            for start, end in ((0, 20), (20, len(ids))):
                meta = TorchAttentionBackend().build_metadata(
                    [end - start], [end], [table], 4, device
                )
                pos = torch.from_numpy(positions[:, start:end]).to(device)
                hidden = model(None, pos, meta, kv, inputs_embeds=embeds[start:end])
            steps.append(model.compute_logits(hidden[-1:]))
            for i in range(len(ids), len(ids) + 3):
                meta = TorchAttentionBackend().build_metadata([1], [i + 1], [table], 4, device)
                pos = torch.from_numpy(decode_positions(i, 1, delta)).to(device)
                hidden = model(torch.tensor([7 + i], device=device), pos, meta, kv)
                steps.append(model.compute_logits(hidden))
        logits[name] = torch.cat(steps)
    assert _rel_err(logits["gpu"], logits["cpu"]) < 5e-2


@pytest.mark.parametrize("arch", [QWEN2_VL, QWEN2_5_VL])
def test_4k_image_runs_in_bounded_memory(arch: str) -> None:
    """3840x2160 -> 154 x 274 = 42,196 patches through a 7B-sized ViT (32 blocks, 1280 wide).

    One [N, N] float32 score matrix would be 7 GB per head; memory-efficient attention keeps
    the whole forward far below that.
    """
    if arch == QWEN2_VL:
        config = _vision(arch, depth=32, dim=1280, heads=16, out=3584)
    else:
        config = _vision(arch, depth=32, dim=1280, heads=16, mlp=3420, out=3584)
        config = VisionConfig(**{**config.__dict__, "fullatt_block_indexes": (7, 15, 23, 31)})
    with torch.device("cuda"):
        tower = VisionTransformer(config).to(torch.bfloat16).eval()
    grid = [(1, 154, 274)]
    pixels = torch.randn(154 * 274, config.patch_input_dim, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.inference_mode():
        tower(pixels, grid)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = tower(pixels, grid)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"{arch}: 42,196 patches in {elapsed:.3f} s, peak {peak_gib:.2f} GiB above weights")
    assert out.shape == (154 * 274 // 4, 3584)
    assert torch.isfinite(out.float()).all()
    assert peak_gib < 6.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_paged_attention_on_cuda(dtype: torch.dtype) -> None:
    atol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    check_paged_equals_dense(dtype, atol, seed=0, max_score_elements=1 << 28, device="cuda")
    check_paged_equals_dense(dtype, atol, seed=1, max_score_elements=100, device="cuda")
