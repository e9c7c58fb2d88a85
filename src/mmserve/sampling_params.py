"""Per-request sampling and stopping parameters (OpenAI / vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. `seed` makes one request's samples reproducible whatever else
    is in the batch. `max_tokens=None` means "up to the model length".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported", param="n")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", param="temperature"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0 and self.top_k != -1:
            raise InvalidRequestError(
                f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}", param="top_k"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens"
            )
        if self.min_tokens < 0:
            raise InvalidRequestError(
                f"min_tokens must be >= 0, got {self.min_tokens}", param="min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (0, -1) else self.top_k
