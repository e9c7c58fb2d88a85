"""`mmserve serve`'s flags, in groups as vLLM groups its own; one EngineArgs field each."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from mmserve.engine.args import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    LOG_LEVELS,
    TOY_MODEL_NAME,
    parse_json_object,
    parse_mm_limits,
)
from mmserve.hashing import HASH_ALGORITHMS
from mmserve.media_flags import (
    add_decode_args,
    add_encoder_pool_args,
    add_url_policy_args,
    add_video_args,
)

API_KEY_ENV = "MMSERVE_API_KEY"


def _json_object(flag: str):
    return _parsed(lambda text: parse_json_object(text, flag))


def _parsed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type` whose ValueError message becomes the usage error as it is."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return checked


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`mmserve serve` flags, grouped as vLLM groups its own (model, device, scheduler, ...)."""
    a = p.add_argument_group("Model").add_argument
    a(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="The model, as vLLM takes it (`mmserve serve Qwen/Qwen2-VL-2B-Instruct`); same as "
        "--model.",
    )
    a(
        "--model",
        default=None,
        metavar="DIR_OR_ID",
        help=f"A Qwen2-VL / Qwen2.5-VL checkpoint: a directory in Hugging Face format, or a hub "
        f"id (org/name, downloaded unless HF_HUB_OFFLINE=1). Default: the bundled toy model, "
        f"served as {TOY_MODEL_NAME!r}.",
    )
    a(
        "--revision",
        default=None,
        help="The hub revision (branch, tag or commit) of a model given as a Hugging Face id.",
    )
    a(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Model name(s) clients may send; answers carry the first. Default: the model "
        "string as given (as vLLM does).",
    )
    a(
        "--tokenizer",
        default=None,
        metavar="DIR_OR_ID",
        help="Tokenizer (and chat template) from another directory or hub id; default: the "
        "model's.",
    )
    a(
        "--tokenizer-revision",
        default=None,
        help="The hub revision of --tokenizer.",
    )
    a(
        "--download-dir",
        default=None,
        metavar="DIR",
        help="Hub cache to look in and download to; default $HF_HUB_CACHE, else $HF_HOME/hub, "
        "else ~/.cache/huggingface/hub. HF_HUB_OFFLINE=1: only what the cache holds.",
    )
    a(
        "--trust-remote-code",
        action="store_true",
        help="Accepted for vLLM command lines; mmserve implements its models itself and never "
        "runs code from a checkpoint (nor downloads any).",
    )
    a(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="Weight and activation dtype; auto: bfloat16 on GPU, float32 on CPU.",
    )
    a(
        "--max-model-len",
        type=int,
        default=None,
        help="Longest prompt + output in tokens; default: the checkpoint's maximum.",
    )
    a("--seed", type=int, default=0, help="Seed of the engine's random state.")
    a(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="Default sampling values (temperature, top_p, top_k, repetition_penalty, "
        "max_new_tokens) for fields a request leaves out: 'auto' reads the model's "
        "generation_config.json, as vLLM does; 'vllm' keeps the engine's defaults; a directory "
        "reads its generation_config.json.",
    )
    a(
        "--max-logprobs",
        type=int,
        default=20,
        help="Most top logprobs a request may ask for (chat top_logprobs, completions "
        "logprobs, offline SamplingParams.logprobs). Default 20, as vLLM.",
    )
    a = p.add_argument_group("Device and parallelism").add_argument
    a("--device", choices=DEVICES, default="auto", help="Where to run; auto: cuda if present.")
    a(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="Fraction of the GPU's memory mmserve may use (weights, activations, KV cache): "
        "a profile run at start-up measures the activation peak of the largest step, and the "
        "KV cache gets what the weights, that peak and a CUDA graph reserve leave. CUDA only "
        "(on the CPU --kv-cache-memory-bytes sizes the cache). Default 0.9.",
    )
    a(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="Devices to split the model over; mmserve runs on one device (1), larger values "
        "are refused at start-up.",
    )
    a(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="Pipeline stages; 1 (larger values are refused at start-up).",
    )
    a(
        "--enforce-eager",
        action="store_true",
        help="Turn off the decode CUDA graphs (captured at start-up, CUDA with the triton "
        "attention backend only) and the encoder CUDA graphs (--enable-encoder-cuda-graph): "
        "every step runs eagerly, and the KV sizing keeps no CUDA graph reserve.",
    )
    a(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        help="Decode batch sizes to capture as CUDA graphs. One value: 1, 2, 4, 8, then steps "
        "of 8 to 64 and of 16 up to it; several: exactly those. Default: that ladder up to "
        "--max-num-seqs. A decode step pads to the next captured size.",
    )
    a(
        "--enable-encoder-cuda-graph",
        action="store_true",
        help="Replay CUDA graphs of the vision encoder: a call is padded to the next of a ladder "
        "of sizes (256 input patches, doubling, up to the encoder budget), each captured on "
        "first use. CUDA and bfloat16/float16 only; --enforce-eager turns it off. Default off.",
    )
    a(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="Language-model attention: triton (Triton kernels, CUDA; on the CPU only with "
        "TRITON_INTERPRET=1) or torch (SDPA, any device). auto: triton on CUDA, else torch.",
    )
    a(
        "--multiprocess",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Run the scheduler and the model in an engine process, apart from the HTTP server "
        "and its media processing (default on for `serve`). --no-multiprocess keeps one process.",
    )
    a = p.add_argument_group("Scheduler").add_argument
    a(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="Token budget of one engine step (prefill chunks + decodes); also the default "
        "encoder cache size (this many embeddings) and per-step encoder budget (the input "
        "patches behind this many embeddings).",
    )
    a(
        "--encoder-patch-budget",
        type=int,
        default=None,
        metavar="PATCHES",
        help="Input patches (grid_t x grid_h x grid_w per image or video) the vision encoder may "
        "process in one engine step: what its activation memory scales with. Default "
        "--max-num-batched-tokens x spatial_merge_size^2, floored at the largest item.",
    )
    a("--max-num-seqs", type=int, default=256, help="Most requests running at once.")
    a(
        "--disable-chunked-mm-input",
        action="store_true",
        help="Never split one image's placeholder span across engine steps; rejected at start "
        "when the largest image needs more than --max-num-batched-tokens.",
    )
    a = p.add_argument_group("Cache").add_argument
    a("--block-size", type=int, default=16, help="Tokens per KV-cache block.")
    a(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse KV blocks of identical prefixes (images keyed by identity). Default on.",
    )
    a(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        metavar="N",
        help="KV pool size in blocks, instead of sizing it from free memory.",
    )
    a(
        "--kv-cache-memory-bytes",
        "--kv-cache-memory",
        type=int,
        default=None,
        metavar="BYTES",
        help="KV pool size in bytes, instead of sizing it by the start-up profile run.",
    )
    a(
        "--hash-algorithm",
        choices=HASH_ALGORITHMS,
        default="blake3",
        help="Digest for item identity and prefix-cache keys (sha256 for FIPS).",
    )
    a(
        "--encoder-cache-size",
        type=int,
        default=None,
        metavar="SLOTS",
        help="Encoder cache size in embedding slots (hidden size x dtype bytes each); default "
        "--max-num-batched-tokens, floored at the largest image or video.",
    )
    a(
        "--encoder-cache-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="Encoder cache size in bytes, instead of --encoder-cache-size; floored at the "
        "largest image or video.",
    )
    a(
        "--mm-processor-cache-gb",
        type=float,
        default=4.0,
        help="Size of the processed-image (CPU stage) cache in GiB; 0 disables it.",
    )
    a(
        "--mm-reencode-cache-gb",
        type=float,
        default=1.0,
        help="GiB of pixels the engine keeps of images a request's prefill has passed, to "
        "encode them again if the request is preempted; a preempted request whose image was "
        "evicted from it fails. Default 1.",
    )
    a = p.add_argument_group("Multimodal and media").add_argument
    a(
        "--limit-mm-per-prompt",
        type=_parsed(parse_mm_limits),
        default=None,
        metavar="JSON",
        help="""Most items per modality in one prompt, e.g. '{"image": 4, "video": 1}' (or """
        """image=4,video=1). Images: no limit unless given; videos: 1 unless given.""",
    )
    a(
        "--mm-processor-kwargs",
        type=_json_object("--mm-processor-kwargs"),
        default=None,
        metavar="JSON",
        help="""Processor overrides, e.g. '{"max_pixels": 1003520}' (images' min/max_pixels); """
        """video keys fps, max_frames, total_pixels set the engine's video sampling.""",
    )
    add_url_policy_args(a)
    a(
        "--trust-exif-image-id",
        action="store_true",
        help="Let an image's EXIF ImageUniqueID stand in for its pixels in the cache identity "
        "(inside the caller's namespace). Off: images are identified by their pixels, since "
        "EXIF comes with the file and two different pictures can carry the same id.",
    )
    add_decode_args(a)
    add_video_args(a)
    add_encoder_pool_args(p.add_argument_group("Encoder pool (disaggregation)").add_argument)
    a = p.add_argument_group("Frontend (HTTP server)").add_argument
    a("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    a("--port", type=int, default=8000, help="Port to listen on (default 8000).")
    a(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help=(
            "Require 'Authorization: Bearer KEY' on /v1/* (several keys: one per tenant, each "
            f"with its own media-UUID namespace); also read from ${API_KEY_ENV} (comma-separated)."
        ),
    )
    a(
        "--max-request-body-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="Largest HTTP request body (data: URLs included); bigger ones get 413.",
    )
    a(
        "--http-header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="A connection must send a request's complete headers within this long of opening "
        "or of the previous response (a deadline: slow bytes do not extend it), else 408 and "
        "close.",
    )
    a(
        "--http-body-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="A request's whole body must arrive within this long of its headers, else 408 "
        "and close.",
    )
    a(
        "--http-keep-alive-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="An idle keep-alive connection is closed after this long without a new request.",
    )
    a("--log-level", choices=LOG_LEVELS, default="info", help="mmserve's log level.")
    a(
        "--uvicorn-log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="uvicorn's log level (access logs appear at info).",
    )
