"""EngineArgs: every `mmserve serve` flag as one frozen, validated value the factory consumes."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from mmserve.disaggregation.discovery import normalise_encoder_url
from mmserve.hashing import HASH_ALGORITHMS
from mmserve.processing.url_guard import parse_allowlist

TOY_MODEL_NAME = "mmserve-toy"
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ENCODER_FALLBACKS = ("local", "fail")
DEFAULT_ENCODER_TIMEOUT_S = 30.0


def bundled_toy_model_dir() -> str:
    """The toy checkpoint shipped inside the package (found without importing torch)."""
    return str(Path(str(resources.files("mmserve"))) / "models" / "toy")


def parse_json_object(text: str, flag: str) -> dict[str, Any]:
    """Parse a flag's JSON object value, with an error that names the flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} must be a JSON object, e.g. '{{\"image\": 4}}': {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def parse_mm_limits(text: str, flag: str = "--limit-mm-per-prompt") -> dict[str, Any]:
    """A JSON object (`'{"image": 4}'`), or the older vLLM form `image=4,video=1`."""
    if text.lstrip().startswith("{"):
        return parse_json_object(text, flag)
    limits: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip().isdigit():
            raise ValueError(
                f"{flag} must be a JSON object like '{{\"image\": 4}}' or image=4,video=1; "
                f"got {text!r}"
            )
        limits[key.strip()] = int(value)
    return limits


def split_domains(values: list[str] | tuple[str, ...] | str | None) -> tuple[str, ...] | None:
    """`--allowed-media-domains a.com b.com` and `--allowed-media-domains a.com,b.com` agree."""
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    out = [part.strip().lower() for v in values for part in v.replace(",", " ").split()]
    return tuple(p for p in out if p)


@dataclass(frozen=True)
class EngineArgs:
    """One field per `mmserve serve` flag (the flag's name in snake_case).

    None means "the engine decides" (for example max_model_len from the checkpoint, the KV pool
    from free memory, the encoder cache from max_num_batched_tokens).
    """

    model: str = field(default_factory=bundled_toy_model_dir)
    # One name or several (clients may send any; answers carry the first).
    served_model_name: str | tuple[str, ...] | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    # Most top logprobs a request may ask for (vLLM's --max-logprobs).
    max_logprobs: int = 20
    block_size: int = 16
    enable_prefix_caching: bool = True
    disable_chunked_mm_input: bool = False
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_cache_gb: float = 4.0
    mm_reencode_cache_gb: float = 1.0
    mm_processor_kwargs: dict[str, Any] | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    allowed_local_media_path: str | None = None
    trust_exif_image_id: bool = False
    max_concurrent_media_fetches: int = 16
    api_key: tuple[str, ...] | None = field(default=None, repr=False)
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    encoder_cache_size: int | None = None  # embedding slots
    encoder_cache_bytes: int | None = None  # or bytes; None: from encoder_cache_size
    encoder_patch_budget: int | None = None  # input patches per step; None: from the token budget
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    hash_algorithm: str = "blake3"
    media_fetch_timeout: float = 5.0
    max_media_bytes: int = 20 * 1024 * 1024
    max_request_body_bytes: int = 64 * 1024 * 1024
    # HTTP server timeouts, in seconds (see api/http_protocol.py for the timeline).
    http_header_timeout: float = 10.0
    http_body_timeout: float = 60.0
    http_keep_alive_timeout: float = 5.0
    log_level: str = "info"
    uvicorn_log_level: str = "warning"
    # Decode memory (issue #20): caps checked from image headers, before any pixel exists.
    max_image_pixels: int | None = None  # None: max(processor max_pixels, 4096 * 4096)
    max_decode_bytes_per_request: int = 1 << 30
    max_inflight_decode_bytes: int = 2 << 30
    decode_wait_timeout: float = 10.0
    decode_worker_max_rss_mb: int = 1024
    # Video ceilings (issue #17, docs/video.md): engine-wide, a request can lower none of them.
    max_video_bytes: int = 64 << 20
    max_video_seconds: float = 600.0
    max_video_frames_decoded: int = 36_000
    max_video_frame_pixels: int = 4096 * 2160
    max_video_decoded_pixels: int = 8 << 30
    video_decode_timeout: float = 30.0
    # The scheduler and the model in an engine process of their own (issue #14). None: the
    # entry point's default (the server: yes; the offline LLM: no).
    multiprocess: bool | None = None
    # Where the checkpoint comes from (issue #18): a hub id's revision, a separate tokenizer,
    # the hub cache to download into.
    revision: str | None = None
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    # vLLM flags a copied command line carries. trust_remote_code: accepted, never acted on (no
    # checkpoint code is run); tensor/pipeline parallel sizes above 1 are refused (one device).
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    # Decode CUDA graphs (issue #15): captured at start-up on CUDA with the Triton backend
    # unless --enforce-eager. cuda_graph_sizes: None, the ladder up to max_num_seqs; one value,
    # the ladder up to it; several, exactly those (vLLM's --cuda-graph-sizes).
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    # Language-model attention (issue #15): auto is triton on CUDA, torch (SDPA) elsewhere.
    attention_backend: str = "auto"
    # Vision encoder CUDA graphs (issue #15): off until measured faster, as in vLLM and SGLang.
    enable_encoder_cuda_graph: bool = False
    # Request defaults from a generation_config.json: "auto" (the model's), "vllm" (none), a dir.
    generation_config: str = "auto"
    # Encode/prefill disaggregation (issue #16, docs/disaggregation.md): images go to these
    # `mmserve encode` servers. The other encoder_* fields need encoder_urls; None: defaults
    # (fallback "local", a 30 s timeout). The secret comes from encoder_secret_file, or
    # encoder_secret (the CLI fills it from $MMSERVE_ENCODER_SECRET).
    encoder_urls: tuple[str, ...] | None = None
    encoder_fallback: str | None = None
    encoder_timeout: float | None = None
    encoder_secret_file: str | None = None
    encoder_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "block_size",
            "max_media_bytes",
            "max_concurrent_media_fetches",
        ):
            _check_positive(name, getattr(self, name))
        if self.allowed_media_domains is not None:
            domains = split_domains(self.allowed_media_domains)
            parse_allowlist(domains or ())  # ValueError names the bad entry
            object.__setattr__(self, "allowed_media_domains", domains)
        _check_positive("max_request_body_bytes", self.max_request_body_bytes)
        for name in (
            "max_model_len",
            "encoder_cache_size",
            "encoder_cache_bytes",
            "encoder_patch_budget",
            "num_gpu_blocks_override",
            "kv_cache_memory_bytes",
        ):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.encoder_cache_size is not None and self.encoder_cache_bytes is not None:
            raise ValueError(
                "--encoder-cache-size (embedding slots) and --encoder-cache-bytes both size the "
                "encoder cache; give only one of them"
            )
        if self.num_gpu_blocks_override is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError(
                "--num-gpu-blocks-override and --kv-cache-memory-bytes both size the KV pool; "
                "give only one of them"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.media_fetch_timeout <= 0:
            raise ValueError(f"--media-fetch-timeout must be > 0 s, got {self.media_fetch_timeout}")
        for name in ("http_header_timeout", "http_body_timeout", "http_keep_alive_timeout"):
            _check_seconds(name, getattr(self, name))
        if self.mm_reencode_cache_gb < 0:
            raise ValueError(
                f"--mm-reencode-cache-gb must be >= 0, got {self.mm_reencode_cache_gb}"
            )
        if self.mm_processor_cache_gb < 0:
            raise ValueError(
                f"--mm-processor-cache-gb must be >= 0 (0 disables the cache), "
                f"got {self.mm_processor_cache_gb}"
            )
        self._check_decode_flags()
        self._check_device_flags()
        self._check_encoder_flags()
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("hash_algorithm", self.hash_algorithm, HASH_ALGORITHMS)
        _check_choice("log_level", self.log_level, LOG_LEVELS)
        _check_choice("uvicorn_log_level", self.uvicorn_log_level, LOG_LEVELS)
        if self.limit_mm_per_prompt is not None:
            for key, value in self.limit_mm_per_prompt.items():
                if not isinstance(key, str) or not isinstance(value, int) or value < 0:
                    raise ValueError(
                        f"--limit-mm-per-prompt maps a modality to a count >= 0, "
                        f"e.g. '{{\"image\": 4}}'; got {key!r}: {value!r}"
                    )
        if self.served_model_name is not None:
            names = self.served_model_name
            names = (names,) if isinstance(names, str) else tuple(names)
            if not names or not all(isinstance(n, str) and n.strip() for n in names):
                raise ValueError("--served-model-name must not be empty")
            object.__setattr__(self, "served_model_name", tuple(dict.fromkeys(names)))
        if self.api_key is not None:
            keys = (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)
            if not keys or not all(isinstance(k, str) and k.strip() for k in keys):
                raise ValueError("--api-key must not be empty (omit it to disable authentication)")
            object.__setattr__(self, "api_key", keys)

    def _check_device_flags(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
            if value > 1:
                raise ValueError(
                    f"{flag} {value}: mmserve runs a model on one device and does not split it "
                    f"across devices yet; use {flag} 1 (a Qwen2-VL-7B in bfloat16 needs ~17 GiB "
                    "plus KV cache, one 24 GiB+ GPU)"
                )
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes)
            if not sizes or not all(_is_positive_int(s) for s in sizes):
                raise ValueError(
                    "--cuda-graph-sizes takes batch sizes >= 1 (one: capture the ladder up to "
                    f"it; several: exactly those), e.g. --cuda-graph-sizes 1 2 4 8; got {sizes!r}"
                )
            object.__setattr__(self, "cuda_graph_sizes", sizes)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                "--gpu-memory-utilization is the fraction of the GPU's memory mmserve may use, "
                f"in (0, 1]; got {self.gpu_memory_utilization}"
            )
        for name in (
            "revision",
            "tokenizer",
            "tokenizer_revision",
            "download_dir",
            "generation_config",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"--{name.replace('_', '-')} must not be empty")
        if self.tokenizer_revision is not None and self.tokenizer is None:
            raise ValueError(
                "--tokenizer-revision needs --tokenizer (the model's own tokenizer follows "
                "--revision)"
            )

    def _check_encoder_flags(self) -> None:
        if self.encoder_urls is None:
            given = [
                "--" + name.replace("_", "-")
                for name in ("encoder_fallback", "encoder_timeout", "encoder_secret_file")
                if getattr(self, name) is not None
            ]
            if self.encoder_secret is not None:
                given.append("MMSERVE_ENCODER_SECRET")
            if given:
                raise ValueError(
                    f"{', '.join(given)} configure the remote encoder pool; give "
                    "--encoder-urls too, or leave them out"
                )
            return
        urls = (self.encoder_urls,) if isinstance(self.encoder_urls, str) else self.encoder_urls
        urls = tuple(normalise_encoder_url(u) for u in urls)
        if not urls:
            raise ValueError("--encoder-urls needs at least one http://host:port")
        if len(set(urls)) != len(urls):
            raise ValueError(f"--encoder-urls names an encoder twice: {list(urls)}")
        object.__setattr__(self, "encoder_urls", urls)
        if self.encoder_fallback is not None:
            _check_choice("encoder_fallback", self.encoder_fallback, ENCODER_FALLBACKS)
        if self.encoder_timeout is not None:
            _check_seconds("encoder_timeout", self.encoder_timeout)
        if self.encoder_secret_file is not None and self.encoder_secret is not None:
            raise ValueError(
                "the encoder secret is given twice (--encoder-secret-file and "
                "MMSERVE_ENCODER_SECRET); give one"
            )
        if self.encoder_secret is not None and not self.encoder_secret.strip():
            raise ValueError("MMSERVE_ENCODER_SECRET is empty; unset it or give a secret")

    @property
    def resolved_encoder_fallback(self) -> str:
        return self.encoder_fallback or "local"

    @property
    def resolved_encoder_timeout(self) -> float:
        return self.encoder_timeout or DEFAULT_ENCODER_TIMEOUT_S

    def _check_decode_flags(self) -> None:
        for name in (
            "max_video_bytes",
            "max_video_seconds",
            "max_video_frames_decoded",
            "max_video_frame_pixels",
            "max_video_decoded_pixels",
            "video_decode_timeout",
        ):
            _check_positive(name, getattr(self, name))
        if self.max_image_pixels is not None:
            _check_positive("max_image_pixels", self.max_image_pixels)
        _check_positive("decode_wait_timeout", self.decode_wait_timeout)
        for name in (
            "max_decode_bytes_per_request",
            "max_inflight_decode_bytes",
            "decode_worker_max_rss_mb",
        ):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 0 (0: no cap), got {getattr(self, name)}")
        per_request, inflight = self.max_decode_bytes_per_request, self.max_inflight_decode_bytes
        if inflight and per_request > inflight:
            raise ValueError(
                f"--max-decode-bytes-per-request ({per_request}) must not exceed "
                f"--max-inflight-decode-bytes ({inflight}): a request holds all its decoded "
                "images at once, so it could never fit"
            )

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """--served-model-name, else `mmserve-toy` for the bundled model, else the --model
        string as given (what vLLM serves a model as, so a vLLM client's `model` works)."""
        if self.served_model_name:
            return tuple(self.served_model_name)
        if Path(self.model).resolve() == Path(bundled_toy_model_dir()).resolve():
            return (TOY_MODEL_NAME,)
        return (str(self.model),)

    @property
    def resolved_served_model_name(self) -> str:
        """The name answers carry: the first of `served_model_names`."""
        return self.served_model_names[0]

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> EngineArgs:
        """Build from parsed flags; JSON-valued flags may still be strings here."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if hasattr(namespace, f.name):
                values[f.name] = getattr(namespace, f.name)
        positional = getattr(namespace, "model_tag", None)  # `mmserve serve MODEL`, as vLLM
        if positional is not None:
            if values.get("model") not in (None, positional):
                raise ValueError(
                    f"the model is given twice, as {positional!r} and as --model "
                    f"{values['model']!r}; give it once"
                )
            values["model"] = positional
        if values.get("model") is None:
            values.pop("model", None)
        if isinstance(values.get("limit_mm_per_prompt"), str):
            values["limit_mm_per_prompt"] = parse_mm_limits(values["limit_mm_per_prompt"])
        if isinstance(values.get("mm_processor_kwargs"), str):
            values["mm_processor_kwargs"] = parse_json_object(
                values["mm_processor_kwargs"], "--mm-processor-kwargs"
            )
        if isinstance(values.get("encoder_urls"), list):
            values["encoder_urls"] = tuple(values["encoder_urls"])
        if "allowed_media_domains" in values:
            values["allowed_media_domains"] = split_domains(values["allowed_media_domains"])
        return cls(**values)


def _check_positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


def _check_seconds(name: str, value: float) -> None:
    if not 0 < value <= 24 * 3600:
        raise ValueError(
            f"--{name.replace('_', '-')} must be > 0 and at most a day (in seconds), got {value}"
        )


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"--{name.replace('_', '-')} must be one of {choices}, got {value!r}")
