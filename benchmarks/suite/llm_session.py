"""One mmserve LLM for a section, sized so that several can run one after another on one GPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.suite.profile import Profile
from benchmarks.suite.timing import release_memory

from mmserve import LLM
from mmserve.engine.args import EngineArgs

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineArgs))


@contextmanager
def open_llm(profile: Profile, model_dir: Path, dtype: str, **extra: Any) -> Iterator[LLM]:
    """A fixed KV pool (not 90% of the GPU) so that the next section's model fits beside what
    the allocator still caches; shut down and released on leaving."""
    llm = LLM(
        model=str(model_dir),
        device=profile.device,
        dtype=dtype,
        kv_cache_memory_bytes=profile.kv_cache_memory_bytes,
        **extra,
    )
    try:
        yield llm
    finally:
        llm.shutdown()
        del llm
        release_memory(profile.device)
