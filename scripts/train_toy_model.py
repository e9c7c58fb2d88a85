"""Train the bundled toy Qwen2-VL checkpoint (src/mmserve/models/toy) on synthetic shape pictures.

    python scripts/train_toy_model.py --out src/mmserve/models/toy --seed 0 --threads 2

Deterministic from --seed (for a fixed thread count); the model card (README.md beside the
weights) records the exact command, the measured training time and the machine load.
Prints held-out greedy accuracy per task, measured with transformers on the saved bf16 weights
loaded back in float32, and writes it into the model card.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer

SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(SCRIPTS), str(SCRIPTS.parent)]

from tests.support.factory import (  # noqa: E402
    QWEN2_VL_CHAT_TEMPLATE,
    build_tokenizer,
    preprocessor_config,
    special_token_ids,
    tiny_config_dict,
)
from toy_aux import AuxHeads  # noqa: E402
from toy_batches import IGNORE_INDEX, Encoded, PixelConfig, SpecialIds, collate, encode  # noqa: E402
from toy_card import TrainStats, last_stage_extra, write_model_card  # noqa: E402
from toy_data import FIRST, TASKS, VARIETIES, WIDE, Variety, sample_example, tokenizer_corpus  # noqa: E402
from toy_stages import StageWalker, focus_task  # noqa: E402

log = logging.getLogger("train_toy_model")

# The first stage's mix: the one-picture questions, shape (the slowest) drawn most. The
# two-picture questions come later, each in a stage of its own that keeps a few one-picture
# questions alive (KEEP), then everything together (CURRICULUM): mixed in from the start they
# stay at chance (see the model card).
TASK_WEIGHTS = {
    "describe": 1.3,
    "colour": 0.2,
    "shape": 1.8,
    "position": 1.5,
    "count": 0.4,
    "which": 0.0,
    "same_colour": 0.0,
    "nth_colour": 0.0,
    "nth_shape": 0.0,
}
KEEP = "describe=0.1,position=0.05,shape=0.05"
CURRICULUM = (
    f"2200:nth_shape=1,{KEEP}",
    f"2700:which=1,nth_shape=0.1,{KEEP}@pairs",
    f"3500:nth_colour=1,{KEEP}",
    f"3800:same_colour=1,{KEEP}",
    "4150:describe=1.2,colour=0.2,shape=1.4,position=1.4,count=0.4,which=1.6,same_colour=0.8,"
    "nth_colour=0.3,nth_shape=0.3@wide",
)
# The last mix, on the wide pictures, runs this many times its planned 1750 steps.
LAST_STAGE_STRETCH = 1.6
# 84x84 to 112x112 pixels: 9-16 image tokens. Fewer tokens per picture train no worse per step
# and each step costs about half of one at 112x112 to 168x168.
MIN_PIXELS, MAX_PIXELS = 84 * 84, 112 * 112
TEXT = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    # A low theta: with head_dim 32 the width band gets the lowest frequencies, and at theta
    # 10000 they barely turn across a 6-token-wide picture, so left and right look alike.
    "rope_parameters": {"rope_type": "default", "rope_theta": 10.0, "mrope_section": [4, 6, 6]},
}
# Qwen2-VL's own template can label each picture ("Picture 1: <|vision_start|>..."), off unless
# the caller passes add_vision_id. With --vision-ids the toy's template labels them by default,
# so the two-image questions can tell the first picture from the second by a nearby token.
LABELLED_CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE.replace(
    "{% if add_vision_id %}", "{% if add_vision_id is not defined or add_vision_id %}"
)
assert LABELLED_CHAT_TEMPLATE != QWEN2_VL_CHAT_TEMPLATE
VISION = {"depth": 4, "embed_dim": 64, "num_heads": 4, "mlp_ratio": 2, "hidden_size": 128}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5900)
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-per-task", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=500, help="steps between held-out checks")
    parser.add_argument("--vision-dim", type=int, default=VISION["embed_dim"])
    parser.add_argument("--vision-lr-scale", type=float, default=1.0)
    parser.add_argument(
        "--aux-weight",
        type=float,
        default=1.0,
        help="weight of the auxiliary shape and colour heads' loss (scripts/toy_aux.py; 0: off)",
    )
    parser.add_argument(
        "--weights",
        default="",
        help="task mix overrides, e.g. 'which=2,same_colour=1.2' (default: TASK_WEIGHTS)",
    )
    parser.add_argument(
        "--stage",
        action="append",
        metavar="STEP:WEIGHTS",
        help="from STEP on, draw only the tasks named in WEIGHTS (e.g. '2400:nth_colour=1'),"
        " in those proportions, with pictures of the variety after '@' (default 'first'; "
        f"one of {', '.join(VARIETIES)}); repeat for a curriculum"
        " (default: CURRICULUM; 'none': no stages)",
    )
    parser.add_argument(
        "--stage-gate",
        type=float,
        default=0.9,
        help="a stage that teaches one question (drawn at least 3 times in 4) runs on until that"
        " question's held-out monitor accuracy"
        " reaches this (0: stages end where planned)",
    )
    parser.add_argument(
        "--stage-max-extra",
        type=int,
        default=500,
        help="the most steps such a stage may run past its planned end",
    )
    parser.add_argument(
        "--last-stage-stretch",
        type=float,
        default=LAST_STAGE_STRETCH,
        help="run the last stage (the mix) this many times its planned length, its learning"
        " rate decaying over the longer stretch as the plan had it; earlier stages unchanged",
    )
    parser.add_argument(
        "--focus-batch-size",
        type=int,
        default=16,
        help="batch size while a stage teaches one question (0: --batch-size)",
    )
    parser.add_argument("--rope-theta", type=float, default=TEXT["rope_parameters"]["rope_theta"])
    parser.add_argument(
        "--mrope-section",
        default=",".join(map(str, TEXT["rope_parameters"]["mrope_section"])),
        help="frequency bands for time, height and width, summing to head_dim / 2",
    )
    parser.add_argument(
        "--vision-rope-theta", type=float, default=10000.0, help="the vision tower's rotary base"
    )
    parser.add_argument("--text-layers", type=int, default=TEXT["num_hidden_layers"])
    parser.add_argument(
        "--vision-ids",
        action="store_true",
        help="chat template labels each picture ('Picture 1: ') unless add_vision_id=False",
    )
    parser.add_argument(
        "--min-pixels", type=int, default=MIN_PIXELS, help="the image processor's min_pixels"
    )
    parser.add_argument(
        "--max-pixels", type=int, default=MAX_PIXELS, help="the image processor's max_pixels"
    )
    parser.add_argument("--threads", type=int, default=0, help="0: one per free core")
    parser.add_argument(
        "--eval-only", action="store_true", help="evaluate the checkpoint in --out, no training"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue training the checkpoint in --out"
    )
    parser.add_argument("--device", default="cpu", help="torch device to train on")
    args = parser.parse_args()
    if args.stage is None:
        args.stage = list(CURRICULUM)
    elif args.stage == ["none"]:
        args.stage = []
    return args


def parse_weights(text: str) -> dict[str, float]:
    """'which=2,same_colour=1.2' -> {"which": 2.0, "same_colour": 1.2}."""
    mix = {}
    for item in filter(None, text.split(",")):
        task, _, weight = item.partition("=")
        if task not in TASK_WEIGHTS:
            raise SystemExit(f"--weights: unknown task {task!r}; expected one of {TASKS}")
        mix[task] = float(weight)
    return mix


def _split_stage(item: str) -> tuple[int, str, Variety]:
    """'1200:which=2@wide' -> (1200, 'which=2', WIDE)."""
    start, sep, rest = item.partition(":")
    if not sep or not start.isdigit():
        raise SystemExit(f"--stage: expected STEP:WEIGHTS[@VARIETY], got {item!r}")
    weights, _, name = rest.partition("@")
    if (name or FIRST.name) not in VARIETIES:
        raise SystemExit(
            f"--stage: unknown picture variety {name!r}; expected one of {', '.join(VARIETIES)}"
        )
    return int(start), weights, VARIETIES[name or FIRST.name]


def parse_stages(items: list[str]) -> dict[int, dict[str, float]]:
    """['1200:which=2,nth_colour=1'] -> {1200: {"which": 2.0, "nth_colour": 1.0, others: 0}}."""
    stages = {}
    for item in items:
        start, weights, _ = _split_stage(item)
        stages[start] = {**dict.fromkeys(TASKS, 0.0), **parse_weights(weights)}
    return stages


def curriculum(args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """{first step: the full task weights from there on}: --weights from step 0, then --stage."""
    mixes = {0: {**TASK_WEIGHTS, **parse_weights(args.weights)}, **parse_stages(args.stage)}
    return dict(sorted(mixes.items()))


def stage_varieties(args: argparse.Namespace) -> dict[int, Variety]:
    """{planned first step: the variety of its pictures} for every stage, step 0's included."""
    return {0: FIRST} | {start: variety for start, _, variety in map(_split_stage, args.stage)}


def free_cores() -> int:
    """Cores not already busy with other work (the 1-minute load average). More threads than
    free cores is far slower, not faster: each step's threads wait on the descheduled one."""
    total = os.cpu_count() or 1
    return max(1, total - int(os.getloadavg()[0] + 0.5))


def build_model(
    ids: dict[str, int], vocab_size: int, seed: int, args: argparse.Namespace
) -> transformers.PreTrainedModel:
    vision = {
        **VISION,
        "embed_dim": args.vision_dim,
        "rope_parameters": {"rope_type": "axial", "rope_theta": args.vision_rope_theta},
    }
    rope = {
        **TEXT["rope_parameters"],
        "rope_theta": args.rope_theta,
        "mrope_section": [int(x) for x in args.mrope_section.split(",")],
    }
    text = {**TEXT, "num_hidden_layers": args.text_layers, "rope_parameters": rope}
    cfg = tiny_config_dict("qwen2_vl", vocab_size, ids, text=text, vision=vision)
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = True
    cfg.pop("architectures")
    cfg["torch_dtype"] = "bfloat16"
    config = transformers.Qwen2VLConfig(**cfg)
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    torch.manual_seed(seed)
    return transformers.Qwen2VLForConditionalGeneration(config)


class Sampler:
    """Encoded examples drawn from the task mix (or one task) with a private seeded stream."""

    def __init__(
        self,
        seed: int,
        tok,
        ids: SpecialIds,
        px: PixelConfig,
        template: str,
        mix: dict[str, float] | None = None,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.tok, self.ids, self.px, self.template = tok, ids, px, template
        self.set_mix(mix)

    def set_mix(self, mix: dict[str, float] | None, variety: Variety = FIRST) -> None:
        """Draw tasks in these proportions (overrides of TASK_WEIGHTS), pictures of this
        variety, from the next pool on."""
        self.variety = variety
        mix = {**TASK_WEIGHTS, **(mix or {})}
        weights = np.array([mix[t] for t in TASKS])
        self.probs = weights / weights.sum()

    def batches(self, batch_size: int, group: int = 4):
        """Endless batches; each group of batches is cut from length-sorted examples so that
        little compute goes to padding."""
        while True:
            pool = sorted(self.draw(batch_size * group), key=lambda e: len(e.prompt_ids))
            order = self.rng.permutation(group)
            for g in order:
                yield pool[g * batch_size : (g + 1) * batch_size]

    def draw(self, num: int, task: str | None = None) -> list[Encoded]:
        out = []
        for _ in range(num):
            name = task or TASKS[self.rng.choice(len(TASKS), p=self.probs)]
            ex = sample_example(self.rng, name, self.variety)
            out.append(encode(ex, self.tok, self.ids, self.px, self.template))
        return out


@torch.no_grad()
def teacher_forced_accuracy(model, batch: list[Encoded], ids: SpecialIds) -> float:
    """Share of examples whose every answer token is the argmax: equals greedy exact match."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in collate(batch, ids).items()}
    labels = inputs.pop("labels")
    logits = model(**inputs).logits[:, :-1]  # [B, L-1, V]
    targets = labels[:, 1:]
    hit = (logits.argmax(-1) == targets) | (targets == -100)
    return hit.all(dim=1).float().mean().item()


@torch.no_grad()
def greedy_accuracy(model, batch: list[Encoded], ids: SpecialIds, tok) -> float:
    """Exact-match accuracy of transformers' greedy generate, one prompt at a time."""
    hits = 0
    for e in batch:
        inputs = collate([e], ids, with_answers=False)
        inputs.pop("labels")
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
        new = out[0, len(e.prompt_ids) :].tolist()
        hits += int(new == e.answer_ids)
    return hits / len(batch)


def answer_loss(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own next-token loss over the answer tokens, with the output layer applied
    only where there is an answer token to predict (a few of each prompt's ~100 positions)."""
    labels = inputs.pop("labels")
    hidden = model.model(**inputs).last_hidden_state[:, :-1]  # [B, L-1, H]
    targets = labels[:, 1:]
    scored = targets != IGNORE_INDEX
    logits = model.lm_head(hidden[scored])  # [num answer tokens, V]
    return torch.nn.functional.cross_entropy(logits.float(), targets[scored])


def lr_at(step: float, total: int, peak: float) -> float:
    warmup = max(1, total // 30)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def save(model, out: Path, ids: SpecialIds) -> None:
    """Write bf16 safetensors and a generation config that stops at <|im_end|>."""
    bf16 = copy.deepcopy(model).to("cpu", torch.bfloat16)
    bf16.generation_config.eos_token_id = [ids.im_end, ids.pad]
    bf16.generation_config.pad_token_id = ids.pad
    bf16.save_pretrained(out, safe_serialization=True)


def train(
    model,
    args,
    sampler: Sampler,
    stages: dict[int, dict[str, float]],
    varieties: dict[int, Variety],
    monitor: dict[str, list[Encoded]],
    ids: SpecialIds,
) -> TrainStats:
    """Train in place; returns the wall time, the busiest 1-minute load average seen and the
    curriculum as it ran."""
    groups = []
    for is_vision in (False, True):
        # The vision tower sits behind the language model and learns slowest: its own lr scale.
        named = [(n, p) for n, p in model.named_parameters() if ("visual" in n) == is_vision]
        scale = args.vision_lr_scale if is_vision else 1.0
        groups.append({"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.01})
        groups.append({"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0})
        groups[-1]["scale"] = groups[-2]["scale"] = scale
    heads = AuxHeads(model.config.text_config.hidden_size).to(args.device)
    model.model.visual.merger.register_forward_hook(heads.capture)
    groups.append({"params": list(heads.parameters()), "weight_decay": 0.0, "scale": 1.0})
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98))
    walker = StageWalker(
        stages, args.stage_gate, args.stage_max_extra, stretch=args.last_stage_stretch
    )
    planned_total = args.steps + last_stage_extra(args)

    def monitor_accuracy(task: str) -> float:
        model.eval()
        return teacher_forced_accuracy(model, monitor[task], ids)

    pictures: dict[int, str] = {}  # as run: {first step: variety name}
    start = time.time()
    max_load = os.getloadavg()[0]
    step = 0
    # --steps is the plan (the last stage stretched); a stage that runs on adds its extra steps
    # to the run (walker.delay).
    while step < planned_total + walker.delay:
        if (mix := walker.next_mix(step, monitor_accuracy)) is not None:
            variety = varieties[walker.planned_start]
            sampler.set_mix(mix, variety)
            pictures[step] = variety.name
            focused = focus_task(mix) is not None and args.focus_batch_size > 0
            batch_size = args.focus_batch_size if focused else args.batch_size
            batches = sampler.batches(batch_size)  # a fresh pool, all in the new mix
            log.info("from step %d: task mix %s, %s pictures", step, mix, variety.name)
        # The schedule follows the plan: it holds its place while a stage runs on.
        planned = walker.planned_step(step)
        for group in opt.param_groups:
            group["lr"] = group["scale"] * lr_at(planned, args.steps, args.lr)
        model.train()
        batch = next(batches)
        inputs = {k: v.to(args.device) for k, v in collate(batch, ids).items()}
        grids = inputs["image_grid_thw"]
        heads.captured.clear()
        loss = answer_loss(model, inputs)
        if args.aux_weight > 0:
            aux = torch.tensor([lab for e in batch for lab in e.aux], device=args.device)
            merge = model.config.vision_config.spatial_merge_size
            loss = loss + args.aux_weight * heads.loss(grids, aux, merge)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step == planned_total + walker.delay - 1
        if step % 50 == 0 or last:
            log.info("step %d loss %.4f (%.0fs)", step, loss.item(), time.time() - start)
            max_load = max(max_load, os.getloadavg()[0])
        if (step + 1) % args.eval_every == 0 or last:
            model.eval()
            accs = {t: teacher_forced_accuracy(model, b, ids) for t, b in monitor.items()}
            log.info("step %d held-out: %s", step + 1, _fmt(accs))
            save(model, args.out, ids)
        step += 1
    seconds = time.time() - start
    return TrainStats(
        seconds, torch.get_num_threads(), max_load, walker.started, walker.ends, pictures
    )


def _fmt(accs: dict[str, float]) -> str:
    return " ".join(f"{t}={a:.3f}" for t, a in accs.items())


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    args = parse_args()
    threads = args.threads or free_cores()
    torch.set_num_threads(threads)
    log.info("training with %d torch threads", threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    if args.eval_only or args.resume:
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        # The card describes the checkpoint in --out, whatever the flags' defaults say.
        config = json.loads((out / "config.json").read_text())
        text_cfg = config["text_config"]
        args.vision_rope_theta = config["vision_config"]["rope_parameters"]["rope_theta"]
        args.rope_theta = text_cfg["rope_parameters"]["rope_theta"]
        args.mrope_section = ",".join(map(str, text_cfg["rope_parameters"]["mrope_section"]))
        args.text_layers = text_cfg["num_hidden_layers"]
        template = json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
        args.vision_ids = template == LABELLED_CHAT_TEMPLATE
        kept = json.loads((out / "preprocessor_config.json").read_text())
        args.min_pixels, args.max_pixels = kept["min_pixels"], kept["max_pixels"]
    else:
        template = LABELLED_CHAT_TEMPLATE if args.vision_ids else QWEN2_VL_CHAT_TEMPLATE
        corpus = tokenizer_corpus(np.random.default_rng(args.seed))
        if args.vision_ids:
            corpus.append("Picture 1: Picture 2:")
        tok = build_tokenizer(out, corpus, vocab_size=512, chat_template=template)
    ids = special_token_ids(tok)
    special = SpecialIds.from_vocab(ids)
    pre = preprocessor_config(args.min_pixels, args.max_pixels)
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    px = PixelConfig.from_dict(pre)
    vocab_size = ((tok.get_vocab_size() + 63) // 64) * 64
    # Held-out examples come from their own stream, never from the training one.
    held_out = Sampler(args.seed + 1_000_003, tok, special, px, template)
    monitor = {t: held_out.draw(64, t) for t in TASKS}
    stats = stages = None
    varieties = stage_varieties(args)
    if not args.eval_only:
        if args.resume:
            model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
                out, dtype=torch.float32
            )
            # Loading records float32 in the sub-configs; the saved checkpoint is bf16 and its
            # config.json should say only that (top level), as a fresh run's does.
            model.config.text_config.dtype = model.config.vision_config.dtype = None
        else:
            model = build_model(ids, vocab_size, args.seed, args)
        log.info("parameters: %d", sum(p.numel() for p in model.parameters()))
        model.to(args.device)
        # A resumed run draws a training stream of its own rather than replaying the first.
        train_seed = args.seed + 1 if args.resume else args.seed
        stages = curriculum(args)
        sampler = Sampler(train_seed, tok, special, px, template)
        stats = train(model, args, sampler, stages, varieties, monitor, special)
        save(model, out, special)
    reloaded = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32
    ).eval()
    evaluation = {t: held_out.draw(args.eval_per_task, t) for t in TASKS}
    accs = {t: greedy_accuracy(reloaded, b, special, tok) for t, b in evaluation.items()}
    log.info("held-out greedy accuracy (bf16 weights, float32 compute): %s", _fmt(accs))
    planned_pictures = {start: v.name for start, v in varieties.items()}
    wide_accs = None
    if WIDE.name in planned_pictures.values():
        held_out.set_mix(None, WIDE)  # after the first draw, which stays as it always was
        wide = {t: held_out.draw(args.eval_per_task, t) for t in TASKS}
        wide_accs = {t: greedy_accuracy(reloaded, b, special, tok) for t, b in wide.items()}
        log.info("held-out greedy accuracy, wide pictures: %s", _fmt(wide_accs))
    num_params = sum(p.numel() for p in reloaded.parameters())
    write_model_card(out, accs, args, num_params, pre, stats, stages, planned_pictures, wide_accs)


if __name__ == "__main__":
    main()
