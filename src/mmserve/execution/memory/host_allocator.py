"""Moved to the leaf mmserve.host_allocator; this name stays until the front end imports it."""

from __future__ import annotations

from mmserve.host_allocator import limit_malloc_arenas

__all__ = ["limit_malloc_arenas"]
