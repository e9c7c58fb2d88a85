"""Configuration in one place: one frozen config per concern, each owning its defaults and flags."""

from mmserve.config.scheduler import CacheConfig, SchedulerConfig

__all__ = ["CacheConfig", "SchedulerConfig"]
