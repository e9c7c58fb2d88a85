"""Which checkpoint is served and how: where it comes from, its dtype, seed and served names."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mmserve.config.flags import check_choice, check_non_empty, flag

TOY_MODEL_NAME = "mmserve-toy"
DTYPES = ("auto", "float32", "bfloat16", "float16")
MODEL = "Model"


def bundled_toy_model_dir() -> str:
    """The toy checkpoint shipped inside the package (found without importing torch)."""
    return str(Path(str(resources.files("mmserve"))) / "models" / "toy")


def dtype_flag() -> str:
    """--dtype, as `serve` and `encode` both take it."""
    return flag(
        "auto",
        choices=DTYPES,
        group=MODEL,
        help="Weight and activation dtype; auto: bfloat16 on GPU, float32 on CPU.",
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """The model: a checkpoint directory or hub id, the names clients use for it, its dtype,
    the engine's seed and the request defaults it brings (generation_config.json)."""

    model: str = flag(
        default_factory=bundled_toy_model_dir,
        group=MODEL,
        metavar="DIR_OR_ID",
        help="A Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense) checkpoint: a directory in Hugging "
        "Face format, or a hub id (org/name, downloaded unless HF_HUB_OFFLINE=1). Default: "
        "the bundled toy model, "
        f"served as {TOY_MODEL_NAME!r}.",
    )
    revision: str | None = flag(
        None,
        group=MODEL,
        help="The hub revision (branch, tag or commit) of a model given as a Hugging Face id.",
    )
    # One name or several (clients may send any; answers carry the first).
    served_model_name: tuple[str, ...] | None = flag(
        None,
        nargs="+",
        group=MODEL,
        metavar="NAME",
        help="Model name(s) clients may send; answers carry the first. Default: the model "
        "string as given (as vLLM does).",
    )
    tokenizer: str | None = flag(
        None,
        group=MODEL,
        metavar="DIR_OR_ID",
        help="Tokenizer (and chat template) from another directory or hub id; default: the "
        "model's.",
    )
    tokenizer_revision: str | None = flag(
        None, group=MODEL, help="The hub revision of --tokenizer."
    )
    download_dir: str | None = flag(
        None,
        group=MODEL,
        metavar="DIR",
        help="Hub cache to look in and download to; default $HF_HUB_CACHE, else $HF_HOME/hub, "
        "else ~/.cache/huggingface/hub. HF_HUB_OFFLINE=1: only what the cache holds.",
    )
    # Accepted for a copied vLLM command line, never acted on: no checkpoint code is run.
    trust_remote_code: bool = flag(
        False,
        action="store_true",
        group=MODEL,
        help="Accepted for vLLM command lines; mmserve implements its models itself and never "
        "runs code from a checkpoint (nor downloads any).",
    )
    dtype: str = dtype_flag()
    seed: int = flag(
        0, type=int, group=MODEL, help="Seed of the engine's random state. Default {default}."
    )
    # Request defaults from a generation_config.json: "auto" (the model's), "vllm" (none), a dir.
    generation_config: str = flag(
        "auto",
        group=MODEL,
        metavar="auto|vllm|DIR",
        help="Default sampling values (temperature, top_p, top_k, repetition_penalty, "
        "max_new_tokens) for fields a request leaves out: 'auto' reads the model's "
        "generation_config.json, as vLLM does; 'vllm' keeps the engine's defaults; a directory "
        "reads its generation_config.json. Default {default}.",
    )
    max_logprobs: int = flag(
        20,
        type=int,
        group=MODEL,
        help="Most top logprobs a request may ask for (chat top_logprobs, completions "
        "logprobs, offline SamplingParams.logprobs). Default {default}, as vLLM.",
    )

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        if (
            not isinstance(self.max_logprobs, int)
            or isinstance(self.max_logprobs, bool)
            or self.max_logprobs < 0
        ):
            raise ValueError(f"--max-logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        for name in ("revision", "tokenizer", "tokenizer_revision", "download_dir"):
            check_non_empty(name, getattr(self, name))
        check_non_empty("generation_config", self.generation_config)
        if self.tokenizer_revision is not None and self.tokenizer is None:
            raise ValueError(
                "--tokenizer-revision needs --tokenizer (the model's own tokenizer follows "
                "--revision)"
            )
        if self.served_model_name is not None:
            names = self.served_model_name
            names = (names,) if isinstance(names, str) else tuple(names)
            if not names or not all(isinstance(n, str) and n.strip() for n in names):
                raise ValueError("--served-model-name must not be empty")
            object.__setattr__(self, "served_model_name", tuple(dict.fromkeys(names)))

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
