"""Default sampling values from a checkpoint's generation_config.json (vLLM's --generation-config).

`auto` (the default, as in vLLM) reads the model directory's file; `vllm` (or `mmserve`) keeps
the engine's own defaults; any other value is a directory holding a generation_config.json.
The values fill only the fields a request leaves out. vLLM's rule is kept: `do_sample` is not
read (a request's temperature decides), and `max_new_tokens` becomes the default max_tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mmserve.errors import InvalidRequestError
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ENGINE_DEFAULTS = ("vllm", "mmserve")
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def load_sampling_defaults(spec: str, model_dir: str | Path, *, log: bool = True) -> dict[str, Any]:
    """The SamplingParams fields (by name) that `spec` sets, checked; {} for engine defaults.
    `log=False` only checks (the CLI does, before start-up, to refuse a bad file early)."""
    if spec in ENGINE_DEFAULTS:
        return {}
    directory = Path(model_dir) if spec == "auto" else Path(spec).expanduser()
    path = directory / "generation_config.json"
    if not path.is_file():
        if spec == "auto":
            return {}
        raise ValueError(
            f"--generation-config {spec}: no generation_config.json there; give a directory "
            f"that has one, 'auto' (the model's) or 'vllm' (the engine's defaults)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config: {path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path} must hold a JSON object")
    defaults = {field: config[key] for key, field in SAMPLING_KEYS.items() if key in config}
    for name, value in defaults.items():
        _check(name, value, path)
    if not log:
        return defaults
    if defaults:
        logger.info(
            "default sampling values from %s (a request's own fields win; "
            "--generation-config vllm turns this off): %s",
            path,
            defaults,
        )
    return defaults


def _check(name: str, value: Any, path: Path) -> None:
    """SamplingParams' own range rules, so a default is valid exactly when a request's is."""
    try:
        SamplingParams(**{name: value})
    except InvalidRequestError as exc:
        key = next(k for k, f in SAMPLING_KEYS.items() if f == name)
        raise ValueError(
            f"--generation-config: {path} has {key}={value!r}, which is not a valid default "
            f"({exc.message}); fix the file or pass --generation-config vllm"
        ) from None
