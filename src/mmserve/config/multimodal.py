"""Multimodal processing configuration: item limits, processor overrides, the CPU-side caches."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mmserve.config.flags import flag, parsed

MEDIA = "Multimodal and media"
CACHE = "Cache"


def parse_json_object(text: str, flag_name: str) -> dict[str, Any]:
    """Parse a flag's JSON object value, with an error that names the flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{flag_name} must be a JSON object, e.g. '{{\"image\": 4}}': {exc}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag_name} must be a JSON object, got {type(value).__name__}")
    return value


def parse_mm_limits(text: str, flag_name: str = "--limit-mm-per-prompt") -> dict[str, Any]:
    """A JSON object (`'{"image": 4}'`), or the older vLLM form `image=4,video=1`."""
    if text.lstrip().startswith("{"):
        return parse_json_object(text, flag_name)
    limits: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip().isdigit():
            raise ValueError(
                f"{flag_name} must be a JSON object like '{{\"image\": 4}}' or image=4,video=1; "
                f"got {text!r}"
            )
        limits[key.strip()] = int(value)
    return limits


@dataclass(frozen=True)
class MultimodalConfig:
    """How prompts' images and videos are processed: how many, at what size, what is cached."""

    limit_mm_per_prompt: dict[str, int] | None = flag(
        None,
        type=parsed(parse_mm_limits),
        group=MEDIA,
        metavar="JSON",
        help="""Most items per modality in one prompt, e.g. '{"image": 4, "video": 1}' (or """
        """image=4,video=1). Images: no limit unless given; videos: 1 unless given.""",
    )
    mm_processor_kwargs: dict[str, Any] | None = flag(
        None,
        type=parsed(lambda text: parse_json_object(text, "--mm-processor-kwargs")),
        group=MEDIA,
        metavar="JSON",
        help="""Processor overrides, e.g. '{"max_pixels": 1003520}' (images' min/max_pixels); """
        """video keys fps, max_frames, total_pixels set the engine's video sampling.""",
    )
    trust_exif_image_id: bool = flag(
        False,
        action="store_true",
        group=MEDIA,
        help="Let an image's EXIF ImageUniqueID stand in for its pixels in the cache identity "
        "(inside the caller's namespace). Off: images are identified by their pixels, since "
        "EXIF comes with the file and two different pictures can carry the same id.",
    )
    mm_processor_cache_gb: float = flag(
        4.0,
        type=float,
        group=CACHE,
        help="Size of the processed-image (CPU stage) cache in GiB; 0 disables it. "
        "Default {default}.",
    )
    mm_reencode_cache_gb: float = flag(
        1.0,
        type=float,
        group=CACHE,
        help="GiB of pixels the engine keeps of images a request's prefill has passed, to "
        "encode them again if the request is preempted; a preempted request whose image was "
        "evicted from it fails. Default {default}.",
    )

    def __post_init__(self) -> None:
        if isinstance(self.limit_mm_per_prompt, str):
            object.__setattr__(
                self, "limit_mm_per_prompt", parse_mm_limits(self.limit_mm_per_prompt)
            )
        if isinstance(self.mm_processor_kwargs, str):
            kwargs = parse_json_object(self.mm_processor_kwargs, "--mm-processor-kwargs")
            object.__setattr__(self, "mm_processor_kwargs", kwargs)
        if self.limit_mm_per_prompt is not None:
            for key, value in self.limit_mm_per_prompt.items():
                if not isinstance(key, str) or not isinstance(value, int) or value < 0:
                    raise ValueError(
                        f"--limit-mm-per-prompt maps a modality to a count >= 0, "
                        f"e.g. '{{\"image\": 4}}'; got {key!r}: {value!r}"
                    )
        if self.mm_reencode_cache_gb < 0:
            raise ValueError(
                f"--mm-reencode-cache-gb must be >= 0, got {self.mm_reencode_cache_gb}"
            )
        if self.mm_processor_cache_gb < 0:
            raise ValueError(
                f"--mm-processor-cache-gb must be >= 0 (0 disables the cache), "
                f"got {self.mm_processor_cache_gb}"
            )
