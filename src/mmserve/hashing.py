"""Full-width, domain-separated digests: multimodal item identity and prefix-cache block keys."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import blake3

HASH_ALGORITHMS = ("blake3", "sha256")


class Hasher:
    """Feeds length-prefixed parts into blake3 (default) or sha256 (FIPS) and returns hex digests.

    Every part is framed with its length, and every digest starts with a domain tag, so that no
    two different part lists (or two different uses) can produce the same input stream.
    """

    def __init__(self, algorithm: str = "blake3") -> None:
        if algorithm not in HASH_ALGORITHMS:
            raise ValueError(
                f"hash algorithm {algorithm!r} is not supported; choose one of {HASH_ALGORITHMS}"
            )
        self.algorithm = algorithm

    def _new(self):  # blake3.blake3 | hashlib._Hash
        return blake3.blake3() if self.algorithm == "blake3" else hashlib.sha256()

    def digest(self, domain: str, parts: Iterable[bytes | str | int]) -> str:
        h = self._new()
        _feed(h, domain.encode())
        for part in parts:
            if isinstance(part, int):
                h.update(b"i")
                h.update(struct.pack("<q", part))
            elif isinstance(part, str):
                h.update(b"s")
                _feed(h, part.encode())
            else:
                h.update(b"b")
                _feed(h, memoryview(part).cast("B"))
        return h.hexdigest()


def _feed(h, data: bytes | memoryview) -> None:
    h.update(struct.pack("<Q", len(data)))
    h.update(data)
