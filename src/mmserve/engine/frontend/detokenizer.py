"""Incremental detokenization and stop-string detection for one request."""

from __future__ import annotations

from collections.abc import Callable, Sequence

# decode(ids, skip_special_tokens) -> str
DecodeFn = Callable[[Sequence[int], bool], str]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without re-decoding the whole sequence.

    Keeps two offsets into the token ids: text before `prefix_offset` is final; tokens in
    [prefix_offset, read_offset) are decoded again together with new ones so that multi-token
    characters (byte-level BPE) come out whole. A trailing U+FFFD means "wait for more bytes".
    """

    def __init__(
        self,
        decode: DecodeFn,
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._skip = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self.stop_reason: str | None = None

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the text they add (after any stop-string truncation)."""
        if self.stop_reason is not None:
            return ""
        before = len(self.text)
        for tok in new_ids:
            self._token_ids.append(tok)
            prefix = self._decode(
                self._token_ids[self._prefix_offset : self._read_offset], self._skip
            )
            full = self._decode(self._token_ids[self._prefix_offset :], self._skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._token_ids)
                if self._check_stop(len(full) - len(prefix)):
                    break
        return self.text[before:]

    def _check_stop(self, num_new_chars: int) -> bool:
        if not self._stop:
            return False
        # a stop string can only end inside the newly added text
        search_from = max(0, len(self.text) - num_new_chars - max(len(s) for s in self._stop) + 1)
        best: tuple[int, str] | None = None
        for s in self._stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        self.text = self.text[: idx + len(s)] if self._include_stop else self.text[:idx]
        self.stop_reason = s
        return True
