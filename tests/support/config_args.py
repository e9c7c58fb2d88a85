"""Configs from a `serve` command line or from flat keywords, for tests of the flags."""

from __future__ import annotations

import dataclasses
from typing import Any

from mmserve.cli import build_parser
from mmserve.config.engine import EngineConfig
from mmserve.config.flags import flag_fields
from mmserve.config.server import ServerConfig
from mmserve.serve_flags import serve_configs


@dataclasses.dataclass(frozen=True)
class ServeConfigs:
    """The engine's and the server's configs, read by flag name as the command line has them."""

    engine: EngineConfig
    server: ServerConfig

    def __getattr__(self, name: str) -> Any:
        for field in dataclasses.fields(self.engine):
            section = getattr(self.engine, field.name)
            if hasattr(section, name):
                return getattr(section, name)
        if hasattr(self.server, name):
            return getattr(self.server, name)
        raise AttributeError(name)


def args_of(*argv: str, environ: dict[str, str] | None = None) -> ServeConfigs:
    """`mmserve serve ARGV` as configs (ValueError as the CLI would report it)."""
    ns = build_parser(with_bench=False).parse_args(["serve", *argv])
    return ServeConfigs(*serve_configs(ns, environ or {}))


def configs_of(**kwargs: Any) -> ServeConfigs:
    """Flat keywords (flag names) as configs: the server's to ServerConfig, the rest to the
    engine's sections."""
    server_keys = {f.name for f, _ in flag_fields(ServerConfig)}
    server = {k: v for k, v in kwargs.items() if k in server_keys}
    engine = {k: v for k, v in kwargs.items() if k not in server_keys}
    return ServeConfigs(EngineConfig.from_kwargs(**engine), ServerConfig(**server))


def serve_configs_of(ns, environ: dict[str, str] | None = None) -> ServeConfigs:
    """Parsed `serve` flags as configs."""
    return ServeConfigs(*serve_configs(ns, environ or {}))
