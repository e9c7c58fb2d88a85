"""mmserve offline vs transformers' batched `generate` on the same image workload, side by side.

The workload: N image requests (mixed sizes; half of them repeat an earlier request's image),
each generating exactly --output-len tokens (EOS ignored on both sides), on one small random
Qwen2-VL checkpoint written by tests/support/factory.py. Both engines run in this process, one
after the other, with the same torch thread count. Prints throughput of each, the ratio, and how
many images each ran through the vision tower.

    .venv/bin/python benchmarks/compare_hf.py [--num-requests 64] [--output-len 32]
    python benchmarks/compare_hf.py --device cuda --dtype bfloat16     # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.factory import random_image, write_tiny_checkpoint  # noqa: E402
from tests.support.oracle import HFOracle  # noqa: E402

from mmserve import LLM, SamplingParams  # noqa: E402

SIZES = [(224, 224), (448, 336), (336, 448), (448, 448), (280, 196)]
# Proportioned like Qwen2-VL-7B at 1/14 width: ViT width ~0.37x the LM's, depth ~1.14x.
SHAPE = {
    "text": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "initializer_range": 0.15,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [8, 12, 12],
        },
    },
    "vision": {
        "hidden_size": 256,
        "embed_dim": 96,
        "depth": 5,
        "num_heads": 4,
        "initializer_range": 0.15,
    },
}
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def build_workload(num_requests: int, seed: int):
    """(prompt, image) pairs; every odd request reuses the image of an earlier request."""
    unique = []
    workload = []
    for i in range(num_requests):
        if i % 2 == 1 and unique:
            image = unique[(i * 7) % len(unique)]
        else:
            w, h = SIZES[len(unique) % len(SIZES)]
            image = random_image(w, h, seed=seed + len(unique))
            unique.append(image)
        prompt = (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\n{IMG}Request {i}: what is in the image?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        workload.append((prompt, image))
    return workload, len(unique)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_mmserve(model_dir: Path, workload, output_len: int, device: str, dtype: str) -> dict:
    llm = LLM(model=str(model_dir), device=device, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    requests = [{"prompt": p, "multi_modal_data": {"image": img}} for p, img in workload]
    llm.generate(requests[:2], params, use_tqdm=False)  # warm-up (not timed)
    before = llm.engine.metrics.snapshot().counters
    _sync(device)
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    _sync(device)
    elapsed = time.perf_counter() - start
    after = llm.engine.metrics.snapshot().counters
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "images_encoded": after["encoder_items_encoded"] - before["encoder_items_encoded"],
        "encoder_calls": after["encoder_forward_calls"] - before["encoder_forward_calls"],
        "prefix_cache_hit_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


@torch.no_grad()
def run_transformers(
    model_dir: Path, workload, output_len: int, batch_size: int, device: str, dtype: str
) -> dict:
    torch_dtype = torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)
    oracle = HFOracle(model_dir, dtype=torch_dtype)  # loaded in its dtype: a 7B fp32 is 33 GB
    model = oracle.model.to(device, torch_dtype)
    pad_id = 0
    model.generation_config.pad_token_id = pad_id

    def batch_inputs(items):
        singles = [oracle.inputs(p, [img]) for p, img in items]
        width = max(s["input_ids"].shape[1] for s in singles)
        ids, mask, types = [], [], []
        for s in singles:
            pad = width - s["input_ids"].shape[1]  # left padding for generation
            ids.append(torch.nn.functional.pad(s["input_ids"][0], (pad, 0), value=pad_id))
            mask.append(torch.nn.functional.pad(s["attention_mask"][0], (pad, 0), value=0))
            types.append(torch.nn.functional.pad(s["mm_token_type_ids"][0], (pad, 0), value=0))
        inputs = {
            "input_ids": torch.stack(ids),
            "attention_mask": torch.stack(mask),
            "mm_token_type_ids": torch.stack(types),
            "pixel_values": torch.cat([s["pixel_values"] for s in singles]).to(torch_dtype),
            "image_grid_thw": torch.cat([s["image_grid_thw"] for s in singles]),
        }
        return {k: v.to(device) for k, v in inputs.items()}, width

    warm, _ = batch_inputs(workload[:2])
    model.generate(**warm, max_new_tokens=2, do_sample=False)
    _sync(device)
    start = time.perf_counter()
    tokens = 0
    outputs = []
    for i in range(0, len(workload), batch_size):
        inputs, width = batch_inputs(workload[i : i + batch_size])
        out = model.generate(**inputs, max_new_tokens=output_len, do_sample=False)
        new = out[:, width:]
        tokens += new.numel()
        outputs.extend(new.tolist())
    _sync(device)
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "images_encoded": len(workload),
        "encoder_calls": -(-len(workload) // batch_size),
        "outputs": outputs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both engines)")
    ap.add_argument(
        "--dtype", default="float32", help="float32 (outputs compared exactly) or bfloat16"
    )
    ap.add_argument("--result-json", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "ckpt", "qwen2_vl", seed=args.seed, **SHAPE)
        workload, num_unique = build_workload(args.num_requests, args.seed)
        ours = run_mmserve(model_dir, workload, args.output_len, args.device, args.dtype)
        theirs = run_transformers(
            model_dir, workload, args.output_len, args.hf_batch_size, args.device, args.dtype
        )
    same = sum(a == b for a, b in zip(ours.pop("outputs"), theirs.pop("outputs"), strict=True))
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    print(
        f"workload: {args.num_requests} requests, {num_unique} unique images, "
        f"{args.output_len} output tokens each, torch threads {torch.get_num_threads()}, "
        f"{args.device} {args.dtype}"
    )
    print(f"{'':14}{'seconds':>10}{'tok/s':>10}{'images encoded':>16}{'ViT calls':>11}")
    for name, r in (("mmserve", ours), ("transformers", theirs)):
        print(
            f"{name:14}{r['seconds']:>10.2f}{r['tokens_per_s']:>10.1f}"
            f"{r['images_encoded']:>16}{r['encoder_calls']:>11}"
        )
    print(
        f"mmserve prefix-cache hits: {ours['prefix_cache_hit_tokens']} of "
        f"{ours['prompt_tokens']} prompt tokens"
    )
    print(f"throughput ratio mmserve / transformers: {ratio:.2f}x")
    print(f"identical greedy outputs: {same}/{args.num_requests}")  # fmt: skip
    if args.result_json:
        args.result_json.write_text(
            json.dumps(
                {
                    "mmserve": ours,
                    "transformers": theirs,
                    "ratio": ratio,
                    "identical_outputs": same,
                },
                indent=2,
            )  # fmt: skip
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
