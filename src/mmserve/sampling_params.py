"""Per-request sampling and stopping parameters (OpenAI / vLLM names), range-checked on entry."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import msgspec
from msgspec.structs import force_setattr

from mmserve.errors import InvalidRequestError, PromptTooLongError
from mmserve.structured_output.params import StructuredOutputParams

logger = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# What the engine takes as a seed (torch.Generator.manual_seed's range; a row's noise is keyed
# by it mod 2**64): any signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = INT64_MIN, 2**64 - 1
# Token ids are int32 on the device; top_k is compared against the vocabulary size there.
INT32_MAX = 2**31 - 1
# Below this a temperature divides logits into overflow; vLLM clamps to it for the same reason.
MIN_SAMPLING_TEMPERATURE = 0.01
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_N = 128  # parallel samples of one request
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ABS_PENALTY = 2.0  # presence_penalty and frequency_penalty, as OpenAI bounds them
MAX_ABS_LOGIT_BIAS = 100.0
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS; their tokenizations are bounded alike
MAX_BAD_WORD_CHARS = 1024
MAX_BAD_WORD_TOKENS = 64
# above any vocabulary we serve (Qwen2: 151,936 ids), so a whole vocabulary fits
MAX_ALLOWED_TOKEN_IDS = 1 << 18


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """How to pick tokens and when to stop.

    temperature 0 means greedy; values in (0, 0.01) are raised to 0.01. `seed` (64-bit signed)
    makes one request's samples reproducible whatever else is in the batch. `max_tokens=None`
    means "up to the model length". Every field is checked here, so the HTTP server and the
    offline `LLM` refuse the same values with the same message. The same value travels to the
    engine process (`wire.codec`), where decoding runs these checks again. Copy with changes
    through `msgspec.structs.replace`.
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
    # a grammar the output must match (JSON schema, regex, choice, Lark); None: free text
    structured_outputs: StructuredOutputParams | None = None
    # None: no logprobs; K >= 0: the sampled token's logprob and the K most likely tokens'
    # (the engine bounds K by --max-logprobs).
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    # keep only tokens whose probability (after temperature) is >= min_p x the top token's
    min_p: float = 0.0
    # None: every token may be sampled; else only these ids (a non-empty list)
    allowed_token_ids: tuple[int, ...] | None = None
    # Words that may not appear in the output (vLLM's semantics): each tokenization of a word
    # (with and without a leading space) is a banned sequence, whose last token is masked
    # when the output ends with the rest of it. The front end tokenizes them into
    # `bad_words_token_ids` (`engine.frontend.llm_engine`); the sampler reads only those.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # None: no prompt logprobs; K >= 0: per prompt token (the first excepted) its logprob
    # and the K most likely tokens' at that position (bounded by --max-logprobs)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        force_setattr(self, "stop", stop)
        force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_int("n", self.n, 1, MAX_N, "the number of samples to return")
        self._check_temperature()
        _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        _check_int("top_k", self.top_k, -1, INT32_MAX, "0 or -1 disables it")
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX, "a 64-bit signed integer")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, INT64_MAX, "at least 1")
        _check_int("min_tokens", self.min_tokens, 0, INT64_MAX, "0 or more")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        self._check_stops()
        self._check_logprobs_and_penalties()
        self._check_token_masks()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(
                    f"{name} must be true or false, got {_preview(getattr(self, name))}",
                    param=name,
                )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputParams
        ):
            raise InvalidRequestError(
                "structured_outputs must be a StructuredOutputParams, got "
                f"{_preview(self.structured_outputs)}",
                param="structured_outputs",
            )

    def _check_temperature(self) -> None:
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}",
                param="temperature",
            )
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            logger.debug(
                "temperature %g raised to %g (smaller values overflow the logits)",
                self.temperature,
                MIN_SAMPLING_TEMPERATURE,
            )
            force_setattr(self, "temperature", MIN_SAMPLING_TEMPERATURE)
        force_setattr(self, "temperature", float(self.temperature))

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"stop has {len(self.stop)} strings, at most {MAX_STOP_STRINGS} are allowed",
                param="stop",
            )
        for text in self.stop:
            if not isinstance(text, str) or not 0 < len(text) <= MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"each stop string must be a non-empty string of at most "
                    f"{MAX_STOP_STRING_CHARS} characters, got {_preview(text)}",
                    param="stop",
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids, at most "
                f"{MAX_STOP_TOKEN_IDS} are allowed",
                param="stop_token_ids",
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, INT32_MAX, "each a token id in [0, 2^31)")

    def _check_logprobs_and_penalties(self) -> None:
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, INT32_MAX, "the number of top logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise InvalidRequestError(
                    f"{name} must be in [-2, 2] (0 disables it), got {value}", param=name
                )
            force_setattr(self, name, float(value))
        _check_float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        force_setattr(self, "repetition_penalty", float(self.repetition_penalty))
        if self.logit_bias is not None:
            force_setattr(self, "logit_bias", _checked_logit_bias(self.logit_bias))

    def _check_token_masks(self) -> None:
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(
                f"min_p must be in [0, 1] (0 disables it), got {self.min_p}", param="min_p"
            )
        force_setattr(self, "min_p", float(self.min_p))
        if self.allowed_token_ids is not None:
            ids = tuple(_checked_list("allowed_token_ids", self.allowed_token_ids))
            if not 0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS:
                raise InvalidRequestError(
                    f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, got "
                    f"{len(ids)}",
                    param="allowed_token_ids",
                )
            for token_id in ids:
                _check_int("allowed_token_ids", token_id, 0, INT32_MAX, "each a token id")
            force_setattr(self, "allowed_token_ids", ids)
        words = tuple(_checked_list("bad_words", self.bad_words or ()))
        if len(words) > MAX_BAD_WORDS:
            raise InvalidRequestError(
                f"bad_words has {len(words)} words, at most {MAX_BAD_WORDS} are allowed",
                param="bad_words",
            )
        for word in words:
            if not isinstance(word, str) or not 0 < len(word.strip()) <= MAX_BAD_WORD_CHARS:
                raise InvalidRequestError(
                    f"each bad word must be a non-blank string of at most {MAX_BAD_WORD_CHARS} "
                    f"characters, got {_preview(word)}",
                    param="bad_words",
                )
        force_setattr(self, "bad_words", words)
        sequences = tuple(
            tuple(_checked_list("bad_words", s))
            for s in _checked_list("bad_words", self.bad_words_token_ids or ())
        )
        if len(sequences) > 2 * MAX_BAD_WORDS or any(
            not 0 < len(s) <= MAX_BAD_WORD_TOKENS for s in sequences
        ):
            raise InvalidRequestError(
                f"bad_words tokenize to at most {2 * MAX_BAD_WORDS} sequences of 1 to "
                f"{MAX_BAD_WORD_TOKENS} tokens each; send fewer or shorter words",
                param="bad_words",
            )
        for token_id in (t for s in sequences for t in s):
            _check_int("bad_words", token_id, 0, INT32_MAX, "token ids of the bad words")
        force_setattr(self, "bad_words_token_ids", sequences)
        if self.prompt_logprobs is not None:
            _check_int(
                "prompt_logprobs", self.prompt_logprobs, 0, INT32_MAX, "the number of top logprobs"
            )

    @property
    def has_token_masks(self) -> bool:
        """Whether some tokens are masked before sampling (allowed ids or bad words)."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        """Whether the logits need penalties or a bias before sampling (most requests: no)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (0, -1) else self.top_k


def check_seed(seed: object) -> None:
    """Raise a typed error naming `seed` unless it is an integer in [-2**63, 2**64 - 1]: what
    the engine checks again past `SamplingParams` (whose own bound is narrower)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
        raise InvalidRequestError(
            f"seed must be an integer in [-2**63, 2**64 - 1], got {_preview(seed)}", param="seed"
        )


def _checked_logit_bias(bias: object) -> dict[int, float]:
    """{token id: bias in [-100, 100]}; the ids are checked against the vocabulary by the
    engine, which knows it."""
    if not isinstance(bias, Mapping):
        raise InvalidRequestError(
            f"logit_bias must map token ids to biases, got {_preview(bias)}", param="logit_bias"
        )
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
            param="logit_bias",
        )
    out: dict[int, float] = {}
    for token_id, value in bias.items():
        _check_int("logit_bias", token_id, 0, INT32_MAX, "keys are token ids")
        _check_float("logit_bias", value)
        if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias values must be in [-100, 100], got {value} for token {token_id}",
                param="logit_bias",
            )
        out[token_id] = float(value)
    return out


def _checked_list(name: str, value: object) -> list:
    """`value` as a list when it is a list or tuple (a string is not a list of words)."""
    if not isinstance(value, list | tuple):
        raise InvalidRequestError(f"{name} must be a list, got {_preview(value)}", param=name)
    return list(value)


def _check_int(name: str, value: object, lo: int, hi: int, hint: str) -> None:
    # bool is an int subclass: `max_tokens=True` would otherwise mean 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(
            f"{name} must be an integer ({hint}), got {_preview(value)}", param=name
        )
    if not lo <= value <= hi:
        raise InvalidRequestError(
            f"{name} must be in [{lo}, {hi}] ({hint}), got {_preview(value)}", param=name
        )


def _check_float(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number, got {_preview(value)}", param=name)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value}", param=name)


def _preview(value: object) -> str:
    """A value for an error message, cut short: the client may have sent megabytes of it."""
    if isinstance(value, int) and value.bit_length() > 128:
        # repr of a very long int raises (Python's int-to-str digit limit) and says nothing
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 64 else text[:60] + "...'"


def resolve_max_tokens(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    *,
    default: int | None = None,
    strict: bool = False,
    prompt_param: str = "messages",
) -> int:
    """The most tokens a request may generate, decided once, at admission: its `max_tokens`,
    or when None `default` (the checkpoint's max_new_tokens) or else what the prompt leaves of
    the model length. `strict` (the HTTP API, as OpenAI): a prompt that leaves no room, or a
    max_tokens over the room, is refused naming the field. Otherwise (the offline API, as
    vLLM's): the value is bounded by the room, and is at least 1 (a prompt that fills the
    model length still yields the one token its last position predicts; a longer one is
    refused by `validate_request`)."""
    room = max_model_len - num_prompt_tokens
    if strict and room <= 0:
        raise PromptTooLongError(
            f"the prompt is {num_prompt_tokens} tokens but the model length is {max_model_len}; "
            "shorten the text, send fewer or smaller images (lower max_pixels)",
            param=prompt_param,
        )
    if strict and max_tokens is not None and max_tokens > room:
        raise InvalidRequestError(
            f"max_tokens is {max_tokens} but the prompt already uses {num_prompt_tokens} of the "
            f"model's {max_model_len} tokens, so at most {room} can be generated; "
            f"lower max_tokens to {room} or less",
            param="max_tokens",
        )
    wanted = default if max_tokens is None else max_tokens
    return max(room if wanted is None else min(room, wanted), 1)
