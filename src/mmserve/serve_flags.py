"""`mmserve serve`'s flags, generated from the config fields, in groups as vLLM groups its own."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from mmserve.config.device import DEVICE
from mmserve.config.engine import EngineConfig, section_types
from mmserve.config.flags import add_flags, values_from
from mmserve.config.model import MODEL
from mmserve.config.multimodal import MEDIA
from mmserve.config.pool import ENCODER_SECRET_ENV, POOL
from mmserve.config.scheduler import CACHE, SCHEDULER
from mmserve.config.server import API_KEY_ENV, FRONTEND, ServerConfig

SERVE_GROUPS = (MODEL, DEVICE, SCHEDULER, CACHE, MEDIA, POOL, FRONTEND)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`mmserve serve` flags: every engine section's and the HTTP server's."""
    model = p.add_argument_group(MODEL)
    model.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="The model, as vLLM takes it (`mmserve serve Qwen/Qwen2-VL-2B-Instruct`); same as "
        "--model.",
    )
    configs = [*section_types().values(), ServerConfig]
    add_flags(p, configs, groups=SERVE_GROUPS, made={MODEL: model})


def serve_configs(
    ns: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's configs from parsed `serve` flags and the environment
    (API keys, the encoder secret). ValueError names the flag at fault."""
    values = argparse.Namespace(**vars(ns))
    positional = getattr(ns, "model_tag", None)  # `mmserve serve MODEL`, as vLLM
    if positional is not None:
        if ns.model not in (None, positional):
            raise ValueError(
                f"the model is given twice, as {positional!r} and as --model {ns.model!r}; "
                "give it once"
            )
        values.model = positional
    if values.api_key is None:
        env_keys = [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
        values.api_key = env_keys or None
    if values.encoder_urls is not None and values.encoder_secret_file is None:
        values.encoder_secret = environ.get(ENCODER_SECRET_ENV) or None
    server = ServerConfig(**values_from(values, ServerConfig))
    return EngineConfig.from_namespace(values), server
