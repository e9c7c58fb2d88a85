"""Write a tiny, randomly initialised Qwen2-VL checkpoint for serving benchmarks, offline.

    python make_tiny_qwen2vl.py OUT_DIR [--seed 0] [--no-check]

Run it with a python that has torch, tokenizers and transformers (and torchvision, which
transformers' AutoProcessor wants for Qwen2-VL): `compare_vllm_cpu.py model` uses the vLLM
venv's. The same seed writes the same weights and tokenizer, so figures stay comparable between
machines and runs.

The model is small so that serving overhead, not arithmetic, dominates a CPU benchmark:

    vision  depth 2, embed_dim 64, 4 heads, mlp_ratio 4, patch 14, spatial merge 2,
            temporal patch 2, quick_gelu; merger output 128 (= text hidden)
    text    hidden 128, intermediate 256, 2 layers, 4 query / 2 KV heads (head_dim 32),
            M-RoPE sections [4, 6, 6] (sum 16 = head_dim / 2), theta 1e6, untied embeddings
    vocab   1024 = 1010 byte-level BPE tokens + the 14 Qwen2-VL special tokens
    dtype   bfloat16

A 448x448 image becomes a 32x32 patch grid, merged 2x2 into 256 image tokens.

After writing, the directory is reloaded with transformers (model, tokenizer, processor) and
one 448x448 image prompt is run through `generate`, unless --no-check is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path

import torch

# The Qwen2-VL special tokens (in the real vocabulary's order) and the chat template its
# instruct checkpoints ship: the same data the test checkpoints use.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.chat_tokens import QWEN2_VL_CHAT_TEMPLATE as CHAT_TEMPLATE  # noqa: E402
from tests.support.chat_tokens import SPECIAL_TOKENS  # noqa: E402

log = logging.getLogger("make_tiny_qwen2vl")

VOCAB_SIZE = 1024

# The pre-tokenizer split of Qwen2's tokenizer.json (contractions, letter runs, single digits,
# punctuation runs, newlines, other whitespace); byte-level mapping follows it.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

IMAGE_PROCESSOR = {
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 56 * 56,
    "max_pixels": 14 * 14 * 4 * 16384,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 14 * 14 * 4 * 16384},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}

CAPTION_TEXT = (
    "the a an of in on at to and or with from is are this that what which how many there here "
    "image picture photo scene shows describe caption question answer please you your assistant "
    "user system helpful left right top bottom middle center corner front behind above below "
    "red green blue yellow orange purple black white grey brown pink colour color bright dark "
    "cat dog bird horse car bus bike tree flower house road sky sea river mountain person child "
    "man woman people table chair window door book cup ball sign small large tall short round "
    "one two three four five six seven eight nine ten first second last next looks like see"
)


def training_corpus(seed: int) -> list[str]:
    """Sentences of caption words and made-up words: enough distinct pairs for 1010 BPE tokens."""
    rng = random.Random(seed)
    onsets = ["", "b", "ch", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "sh", "t", "v", "z"]
    nuclei = ["a", "e", "i", "o", "u", "ea", "oo", "ai"]
    codas = ["", "", "n", "r", "s", "t", "ck", "ng"]
    syllables = [o + n + c for o in onsets for n in nuclei for c in codas]
    made_up = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(2000)]
    vocabulary = CAPTION_TEXT.split() * 8 + made_up
    sentences = []
    for _ in range(5000):
        words = rng.choices(vocabulary, k=rng.randint(3, 14))
        sentence = " ".join(words).capitalize() + rng.choice(".?!,:;")
        if rng.random() < 0.25:
            sentence += f" {rng.randint(0, 10**6)} ({rng.choice(made_up)})"
        sentences.append(sentence)
    return sentences


def write_tokenizer(out: Path, seed: int) -> dict[str, int]:
    """Train the BPE tokenizer and save it with its config; return the special token ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "split_special_tokens": False,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def model_config(ids: dict[str, int]):
    from transformers import Qwen2VLConfig

    pad, eos = ids["<|endoftext|>"], ids["<|im_end|>"]
    text = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    vision = {
        "depth": 2,
        "embed_dim": 64,
        "hidden_size": 128,
        "num_heads": 4,
        "mlp_ratio": 4,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "hidden_act": "quick_gelu",
    }
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def write_checkpoint(out: Path, seed: int) -> None:
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, seed)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(model_config(ids)).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    num_params = sum(p.numel() for p in model.parameters())
    image = {"image_processor_type": "Qwen2VLImageProcessor", **IMAGE_PROCESSOR}
    video = {"video_processor_type": "Qwen2VLVideoProcessor", **IMAGE_PROCESSOR}
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    log.info("wrote %s: %d parameters, special ids %s", out, num_params, ids)


def check_checkpoint(out: Path) -> None:
    """Reload with transformers and run a 448x448 image prompt; raise if anything is off."""
    import numpy as np
    from PIL import Image
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    probe = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many cats? 42.<|im_end|>"
    )
    raw_ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode(probe).ids
    hf_ids = AutoTokenizer.from_pretrained(out).encode(probe)
    if hf_ids != raw_ids:
        raise RuntimeError(f"transformers tokenizes differently: {hf_ids} vs {raw_ids}")

    model = Qwen2VLForConditionalGeneration.from_pretrained(out, dtype=torch.bfloat16).eval()
    pixels = np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8)
    inputs = processor_inputs(out, Image.fromarray(pixels))
    grid = inputs["image_grid_thw"].tolist()
    if grid != [[1, 32, 32]]:
        raise RuntimeError(f"448x448 image gave grid {grid}, expected [[1, 32, 32]]")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new_ids = generated[0, inputs["input_ids"].shape[1] :].tolist()
    log.info(
        "transformers check passed: prompt %d tokens, greedy %s",
        inputs["input_ids"].shape[1],
        new_ids,
    )


def processor_inputs(out: Path, image) -> dict:
    """Model inputs for one image prompt, through AutoProcessor where it can load.

    transformers' Qwen2-VL processor also builds the video processor, which needs torchvision;
    without torchvision the image processor and tokenizer are driven by hand, the same way.
    """
    import importlib.util

    from transformers import AutoProcessor, AutoTokenizer, Qwen2VLImageProcessor

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}]
    if importlib.util.find_spec("torchvision") is not None:
        processor = AutoProcessor.from_pretrained(out)
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return processor(text=[prompt], images=[image], return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(out)
    pixels = Qwen2VLImageProcessor.from_pretrained(out)(images=[image], return_tensors="pt")
    num_image_tokens = int(pixels["image_grid_thw"].prod()) // 4  # 2x2 spatial merge
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * num_image_tokens)
    return {**tokenizer([prompt], return_tensors="pt"), **pixels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip the transformers reload")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_checkpoint(args.out_dir, args.seed)
    if not args.no_check:
        check_checkpoint(args.out_dir)


if __name__ == "__main__":
    main()
