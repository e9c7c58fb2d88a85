"""Where a checkpoint's files are: a local directory, or a Hugging Face hub id resolved to one.

`mmserve serve Qwen/Qwen2-VL-2B-Instruct` works as in vLLM: the id is looked up in the hub
cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`, or
`--download-dir`) and downloaded there when missing, unless `HF_HUB_OFFLINE=1`, which allows
only what the cache holds. Only the files serving needs are fetched (configs, tokenizer,
chat template, safetensors weights): never a pickle checkpoint, never code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

from mmserve.config.engine import EngineConfig

logger = logging.getLogger(__name__)

# What a Qwen2-VL checkpoint directory needs; `*.bin` / `*.pt` (pickle) and `*.py` (remote code)
# are never downloaded.
HUB_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")
# The hub's id grammar: `name` or `org/name`, letters, digits, `-`, `_`, `.`, at most 96 chars
# per part.
_HUB_ID = re.compile(r"^(?:[\w.-]{1,96}/)?[\w.-]{1,96}$")
_TRUTHY = {"1", "on", "yes", "true"}


class ModelNotFoundError(ValueError):
    """Neither a local directory nor a resolvable hub id; the message names both attempts."""


def resolve_model_dir(
    model: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    what: str = "--model",
) -> Path:
    """The local directory that holds `model`'s files.

    A path that exists is used as it is (`revision` then has no meaning and is refused, so a
    pinned revision is never silently dropped). Otherwise `model` must look like a hub id.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ModelNotFoundError(
                f"{what} {model} is a local directory, so --revision {revision} cannot apply; "
                "drop --revision or pass a hub id"
            )
        return path
    if path.exists():
        raise ModelNotFoundError(f"{what} {model}: not a directory")
    if model.startswith((".", "/", "~")) or not _HUB_ID.match(model):
        raise ModelNotFoundError(
            f"{what} {model}: no such directory, and not a Hugging Face hub id (org/name)"
        )
    return _from_hub(model, revision, download_dir, what)


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """The hub cache, read from the environment now (not when huggingface_hub was imported)."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    return Path(home).expanduser() / "hub"


def is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY


def _from_hub(model: str, revision: str | None, download_dir: str | None, what: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a runtime dependency; only a broken install lacks it
        raise ModelNotFoundError(
            f"{what} {model}: no such directory, and huggingface_hub is not installed to "
            "resolve it as a hub id"
        ) from None
    cache_dir = hub_cache_dir(download_dir)
    offline = is_offline()
    at = f"@{revision}" if revision else ""
    logger.info(
        "%s %s%s is not a directory: resolving it as a Hugging Face hub id in %s%s",
        what,
        model,
        at,
        cache_dir,
        " (HF_HUB_OFFLINE: cache only)" if offline else "",
    )
    try:
        local = snapshot_download(
            model,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=offline,
            allow_patterns=list(HUB_FILE_PATTERNS),
        )
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes one clear message
        where = "the local hub cache" if offline else "the Hugging Face hub"
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        hint = "; unset HF_HUB_OFFLINE to download it" if offline else ""
        raise ModelNotFoundError(
            f"{what} {model}{at}: no such directory, and not found in {where} "
            f"({cache_dir}): {reason}{hint}"
        ) from None
    local_dir = Path(str(local))
    if not (local_dir / "config.json").is_file():
        raise ModelNotFoundError(
            f"{what} {model}{at}: resolved to {local_dir}, which has no config.json; "
            "is it a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint?"
        )
    logger.info("%s %s%s resolved to %s", what, model, at, local_dir)
    return local_dir


def with_local_sources(config: EngineConfig) -> EngineConfig:
    """`config` with the model (and any --tokenizer) as local directories, hub ids resolved.

    The served name stays the string the user gave (a hub id is served as itself, as in
    vLLM), so resolving twice is harmless and the engine process never touches the hub.
    """
    ckpt = config.checkpoint
    model_dir = resolve_model_dir(
        ckpt.model, revision=ckpt.revision, download_dir=ckpt.download_dir
    )
    tokenizer_dir = None
    if ckpt.tokenizer is not None:
        tokenizer_dir = str(
            resolve_model_dir(
                ckpt.tokenizer,
                revision=ckpt.tokenizer_revision,
                download_dir=ckpt.download_dir,
                what="--tokenizer",
            )
        )
    if str(model_dir) == ckpt.model and tokenizer_dir == ckpt.tokenizer:
        return config
    local = dataclasses.replace(
        ckpt,
        model=str(model_dir),
        served_model_name=ckpt.served_model_names,
        revision=None,
        tokenizer=tokenizer_dir,
        tokenizer_revision=None,
    )
    return dataclasses.replace(config, checkpoint=local)
