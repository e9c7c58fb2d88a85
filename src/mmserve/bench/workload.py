"""Builds a repeatable list of chat requests: synthetic images and text, or a JSONL dataset."""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# Short common words: most BPE tokenizers give about one token per " word", so N words is
# roughly N prompt tokens. The server's streamed `usage` gives the exact count.
_WORD_LIST = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show "
    "every good me give our under name very through just form sentence great think say help "
    "low line differ turn cause"
)


class WorkloadError(ValueError):
    """A workload option or dataset file is invalid; the message says how to fix it."""


@dataclass(frozen=True)
class WorkloadConfig:
    num_prompts: int
    seed: int = 0
    image_sizes: tuple[tuple[int, int], ...] = ((448, 448),)  # (width, height)
    images_per_request: int = 1
    repeat_ratio: float = 0.0
    # each request's images drawn from this many, every one sent equally often (shuffled)
    unique_images: int | None = None
    shared_prefix_tokens: int = 0
    input_len: int = 32
    output_len: int = 32
    image_format: str = "jpeg"
    dataset_path: str | None = None

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise WorkloadError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not 0.0 <= self.repeat_ratio <= 1.0:
            raise WorkloadError(f"--repeat-ratio must be in [0, 1], got {self.repeat_ratio}")
        if self.unique_images is not None:
            if self.repeat_ratio:
                raise WorkloadError("--unique-images and --repeat-ratio both say what repeats")
            if not 1 <= self.unique_images <= self.num_prompts:
                raise WorkloadError(
                    f"--unique-images must be in [1, --num-prompts], got {self.unique_images}"
                )
        if self.images_per_request < 0:
            raise WorkloadError("--images-per-request must be >= 0")
        if self.images_per_request > 0 and not self.image_sizes:
            raise WorkloadError("--image-sizes is empty; give e.g. 448x448,1024x1024")
        for name in ("shared_prefix_tokens", "input_len"):
            if getattr(self, name) < 0:
                raise WorkloadError(f"--{name.replace('_', '-')} must be >= 0")
        if self.output_len < 1:
            raise WorkloadError(f"--output-len must be >= 1, got {self.output_len}")
        if self.image_format not in ("jpeg", "png"):
            raise WorkloadError(f"--image-format must be jpeg or png, got {self.image_format!r}")


@dataclass(frozen=True)
class BenchRequest:
    messages: list[dict[str, Any]]
    max_tokens: int
    num_images: int = 0
    # Images whose exact bytes were already sent by an earlier request of this workload.
    num_repeated_images: int = 0


def parse_image_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """'448x448,1024x768' -> ((448, 448), (1024, 768)); sizes are WIDTHxHEIGHT."""
    sizes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            width, height = (int(v) for v in part.lower().split("x"))
        except ValueError:
            msg = f"bad image size {part!r}: write WIDTHxHEIGHT, e.g. 448x448"
            raise WorkloadError(msg) from None
        if width < 1 or height < 1:
            raise WorkloadError(f"bad image size {part!r}: both sides must be >= 1")
        sizes.append((width, height))
    return tuple(sizes)


def synthetic_image_bytes(rng: np.random.Generator, width: int, height: int, fmt: str) -> bytes:
    """A smooth random pattern (sum of plane waves per channel), encoded as JPEG q=90 or PNG.

    Noise would make every JPEG/PNG several times larger than a photo of the same size and
    benchmark base64 transfer instead of the model; smooth waves compress like a real image.
    """
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)  # [height, width] each
    channels = []
    for _ in range(3):
        fx, fy = rng.uniform(-0.05, 0.05, size=2)
        phase = rng.uniform(0, 2 * np.pi)
        channels.append(127.5 + 127.0 * np.sin(fx * xs + fy * ys + phase))
    pixels = np.stack(channels, axis=-1).astype(np.uint8)  # [height, width, 3]
    buf = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    else:
        Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def random_text(rng: np.random.Generator, num_words: int) -> str:
    words = _WORD_LIST.split()
    return " ".join(words[i] for i in rng.integers(0, len(words), size=num_words))


def _data_url(data: bytes, fmt: str) -> str:
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode('ascii')}"


def build_synthetic(cfg: WorkloadConfig) -> list[BenchRequest]:
    """Exactly round(repeat_ratio * num_prompts) requests (never the first) reuse the images of
    an earlier, non-repeating request, byte for byte, so identity hashing sees the same item.
    With `unique_images` k instead, the requests send k image sets, each as often as the others
    (to within one), in a shuffled order: the first time one comes it is new, then a repeat."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_prompts
    num_repeats = min(round(cfg.repeat_ratio * n), n - 1) if cfg.images_per_request else 0
    repeat_idx = set(rng.choice(np.arange(1, n), size=num_repeats, replace=False).tolist())
    # --unique-images k: request i sends image set picks[i]; set j comes n/k times (+1 for the
    # first n % k), in a shuffled order
    picks = None
    if cfg.unique_images is not None and cfg.images_per_request:
        picks = rng.permutation(np.arange(n) % cfg.unique_images).tolist()
    system = random_text(rng, cfg.shared_prefix_tokens) if cfg.shared_prefix_tokens else None
    originals: list[list[bytes]] = []  # image bytes of each non-repeating request, in order
    by_pick: dict[int, list[bytes]] = {}
    seen: set[bytes] = set()
    requests = []
    for i in range(n):
        earlier = None
        if i in repeat_idx:
            earlier = originals[int(rng.integers(0, len(originals)))]
        elif picks is not None:
            earlier = by_pick.get(picks[i])
        if earlier is not None:
            images, num_repeated = earlier, len(earlier)
        else:
            images = []
            for _ in range(cfg.images_per_request):
                width, height = cfg.image_sizes[int(rng.integers(0, len(cfg.image_sizes)))]
                data = synthetic_image_bytes(rng, width, height, cfg.image_format)
                assert data not in seen, "synthetic images must be distinct"
                seen.add(data)
                images.append(data)
            originals.append(images)
            if picks is not None:
                by_pick[picks[i]] = images
            num_repeated = 0
        # The unique text goes before the images: a repeated image then sits after a prefix that
        # differs, so the prefix cache cannot cover it and the encoder cache tier is exercised.
        text = f"Request {i}. " + random_text(rng, cfg.input_len)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        content += [
            {"type": "image_url", "image_url": {"url": _data_url(d, cfg.image_format)}}
            for d in images
        ]
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": content})
        requests.append(BenchRequest(messages, cfg.output_len, len(images), num_repeated))
    return requests


def load_dataset(cfg: WorkloadConfig) -> list[BenchRequest]:
    """Reads a JSONL file, one request per line: {"messages": [...], "max_tokens": N} (or a bare
    list of messages). Lines are used in file order and cycled to reach num_prompts."""
    assert cfg.dataset_path is not None
    path = Path(cfg.dataset_path)
    if not path.is_file():
        raise WorkloadError(f"--dataset {path} does not exist or is not a file")
    rows = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        rows.append(_dataset_row(row, f"{path}:{line_no}", cfg.output_len))
    if not rows:
        raise WorkloadError(f"--dataset {path} holds no requests; write one JSON object a line")
    seen_urls: set[str] = set()
    requests = []
    for i in range(cfg.num_prompts):
        messages, max_tokens = rows[i % len(rows)]
        urls = [u for m in messages for u in _image_urls(m)]
        num_repeated = sum(u in seen_urls for u in urls)
        seen_urls.update(urls)
        requests.append(BenchRequest(messages, max_tokens, len(urls), num_repeated))
    return requests


def _dataset_row(row: Any, where: str, default_output_len: int) -> tuple[list[dict], int]:
    messages = row.get("messages") if isinstance(row, dict) else row
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise WorkloadError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}]}}')
    max_tokens = default_output_len
    if isinstance(row, dict):
        max_tokens = row.get("max_completion_tokens", row.get("max_tokens", default_output_len))
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise WorkloadError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
    return messages, max_tokens


def _image_urls(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [
        str(part.get("image_url", {}).get("url", ""))
        for part in content
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]


def build_workload(cfg: WorkloadConfig) -> list[BenchRequest]:
    return load_dataset(cfg) if cfg.dataset_path else build_synthetic(cfg)
