"""EngineConfig: the engine's configuration, one section per concern; what the engine process
receives (the HTTP server's settings are not part of it)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mmserve.config.device import DeviceConfig
from mmserve.config.flags import flag_fields, flag_values, values_from
from mmserve.config.media import MediaConfig
from mmserve.config.model import CheckpointConfig
from mmserve.config.multimodal import MultimodalConfig
from mmserve.config.parallel import ParallelConfig
from mmserve.config.pool import EncoderPoolConfig
from mmserve.config.scheduler import CacheConfig, SchedulerConfig
from mmserve.config.server import ServerConfig

# Settable by keyword though no flag sets them (the CLI fills it from the environment).
_KEYWORD_ONLY = {EncoderPoolConfig: ("encoder_secret",)}


@dataclass(frozen=True)
class EngineConfig:
    """Every section the engine reads; `from_kwargs` takes the flags' names, flat."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    multimodal: MultimodalConfig = field(default_factory=MultimodalConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    encoder_pool: EncoderPoolConfig = field(default_factory=EncoderPoolConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The offline API's keywords (`LLM(max_num_seqs=4, ...)`): each flag's field name,
        routed to the section that owns it. TypeError for a name no section has."""
        types = section_types()
        sections: dict[str, dict[str, Any]] = {name: {} for name in types}
        owners = keyword_owners()
        for key, value in kwargs.items():
            if key not in owners:
                if key in {f.name for f, _ in flag_fields(ServerConfig)}:
                    raise TypeError(
                        f"{key!r} is an HTTP server setting (`mmserve serve --"
                        f"{key.replace('_', '-')}`); the engine has no server"
                    )
                raise TypeError(f"unknown engine argument {key!r}")
            sections[owners[key]][key] = value
        return cls(**{name: types[name](**values) for name, values in sections.items()})

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> EngineConfig:
        """From parsed `serve` flags (each section reads the fields it owns)."""
        types = section_types()
        return cls(**{name: t(**values_from(namespace, t)) for name, t in types.items()})

    def flag_values(self) -> dict[str, Any]:
        """Every flag's value by field name, flat (for the start-up log)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            out.update(flag_values(getattr(self, f.name)))
        return out


def section_types() -> dict[str, type]:
    """EngineConfig's sections by field name (each field's default factory is its type)."""
    return {f.name: f.default_factory for f in dataclasses.fields(EngineConfig)}  # type: ignore[misc]


def keyword_owners() -> dict[str, str]:
    """The section that owns each keyword `from_kwargs` takes."""
    owners: dict[str, str] = {}
    for name, cls in section_types().items():
        for f, _ in flag_fields(cls):
            owners[f.name] = name
        for key in _KEYWORD_ONLY.get(cls, ()):
            owners[key] = name
    return owners
