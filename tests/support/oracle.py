"""transformers as the reference: greedy generation for a prompt with images, built independently
of mmserve's processing (HF's PIL image processor, our own placeholder expansion)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from tokenizers import Tokenizer

from mmserve.models.config import ModelConfig


class HFOracle:
    def __init__(
        self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        import transformers

        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        cls = getattr(transformers, config["architectures"][0])
        self.model = cls.from_pretrained(model_dir, dtype=dtype).eval().to(device)
        # Generate exactly max_new_tokens like mmserve's ignore_eos: EOS may be sampled but does
        # not stop generation (min_new_tokens would instead forbid it, which is not the same).
        self.model.generation_config.eos_token_id = None
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        pp = json.loads((model_dir / "preprocessor_config.json").read_text())
        size = pp.get("size") or {}
        # Qwen3-VL's file has patch 16, mean/std 0.5 and the caps as size.{shortest,longest}_edge
        self.processor = transformers.Qwen2VLImageProcessorPil(
            min_pixels=pp.get("min_pixels", size.get("shortest_edge")),
            max_pixels=pp.get("max_pixels", size.get("longest_edge")),
            patch_size=pp["patch_size"],
            image_mean=pp["image_mean"],
            image_std=pp["image_std"],
        )
        self.image_token_id = config["image_token_id"]
        self.merge = 2
        # greedy answers by their full input: the fixtures that hold an oracle live for a session
        # and parametrized tests ask it the same questions (the model is never changed)
        self._greedy_answers: dict[tuple, list[int]] = {}

    def inputs(self, prompt: str, images: list[Image.Image]) -> dict:
        ids = self.tok.encode(prompt, add_special_tokens=False).ids
        out: dict = {}
        if images:
            feats = self.processor(images=images, return_tensors="pt")
            grids = feats["image_grid_thw"].tolist()
            expanded: list[int] = []
            k = 0
            for t in ids:
                if t == self.image_token_id:
                    n = grids[k][0] * grids[k][1] * grids[k][2] // self.merge**2
                    expanded += [t] * n
                    k += 1
                else:
                    expanded.append(t)
            assert k == len(images)
            ids = expanded
            out["pixel_values"] = feats["pixel_values"]
            out["image_grid_thw"] = feats["image_grid_thw"]
        input_ids = torch.tensor([ids])
        out["input_ids"] = input_ids
        out["attention_mask"] = torch.ones_like(input_ids)
        out["mm_token_type_ids"] = (input_ids == self.image_token_id).long()
        return out

    def greedy(self, prompt: str, images: list[Image.Image], max_new_tokens: int) -> list[int]:
        pictures = tuple((im.mode, im.size, im.tobytes()) for im in images)
        key = (prompt, pictures, max_new_tokens)
        if key not in self._greedy_answers:
            self._greedy_answers[key] = self._generate(prompt, images, max_new_tokens)
        return list(self._greedy_answers[key])

    @torch.no_grad()
    def _generate(self, prompt: str, images: list[Image.Image], max_new_tokens: int) -> list[int]:
        inputs = {k: v.to(self.model.device) for k, v in self.inputs(prompt, images).items()}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        n = inputs["input_ids"].shape[1]
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, n:].tolist()

    @torch.no_grad()
    def next_logits(
        self, prompt: str, images: list[Image.Image], prefix: list[int]
    ) -> torch.Tensor:
        """float32 logits [vocab] of the token after the prompt and `prefix` (teacher-forced)."""
        inputs = {k: v.to(self.model.device) for k, v in self.inputs(prompt, images).items()}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        if prefix:
            extra = torch.tensor([prefix], device=self.model.device)
            inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
            inputs["mm_token_type_ids"] = torch.cat(
                [inputs["mm_token_type_ids"], torch.zeros_like(extra)], dim=1
            )
        return self.model(**inputs).logits[0, -1].float().cpu()


@dataclass
class LoadedPair:
    model_dir: Path
    model: torch.nn.Module
    config: ModelConfig
    hf: torch.nn.Module  # the transformers model of the same checkpoint (the oracle)
