"""mmserve: a serving engine for vision-language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputParams", "__version__"]

if TYPE_CHECKING:
    from mmserve.engine.frontend.llm import LLM
    from mmserve.sampling_params import SamplingParams
    from mmserve.structured_output.params import StructuredOutputParams


def __getattr__(name: str) -> Any:
    # Lazy so that `import mmserve` does not pull in torch.
    if name == "LLM":
        from mmserve.engine.frontend.llm import LLM

        return LLM
    if name == "SamplingParams":
        from mmserve.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputParams":
        from mmserve.structured_output.params import StructuredOutputParams

        return StructuredOutputParams
    raise AttributeError(f"module 'mmserve' has no attribute {name!r}")
