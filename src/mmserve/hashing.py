"""Full-width, domain-separated digests: multimodal item identity and prefix-cache block keys."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import blake3

HASH_ALGORITHMS = ("blake3", "sha256")
DEFAULT_HASH_ALGORITHM = "blake3"  # --hash-algorithm's default


def content_digest(data: bytes | memoryview) -> str:
    """The blake3 hex digest of an item's media bytes, whatever --hash-algorithm says: the
    language-model side plans a remote image with it and the encoder pool recomputes it over
    what it receives or fetches, so both ends must use this one function."""
    return blake3.blake3(data).hexdigest()


class Hasher:
    """Feeds length-prefixed parts into blake3 (default) or sha256 (FIPS) and returns hex digests.

    Every part is framed with its length, and every digest starts with a domain tag, so that no
    two different part lists (or two different uses) can produce the same input stream.
    """

    def __init__(self, algorithm: str = DEFAULT_HASH_ALGORITHM) -> None:
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


# ---- Multimodal item identity -------------------------------------------------------------
#
#   identity = digest("mm-item/v1", model id, revision, processor fingerprint, modality,
#                     content key, effective decision)
#
# content key is ("pixels", mode, width, height, palette, raw bytes) for a decoded image, or
# ("uuid" | "exif", namespace, value) when the caller names the item: a claim trusted only
# inside the namespace that made it. The file's EXIF ImageUniqueID is such a claim only when
# the server trusts it (--trust-exif-image-id): it comes with the file, not from the caller.
# The decision is what processing actually did (resized size, grid), never the raw kwargs,
# so a cap that changes nothing for this image changes nothing in its identity.

DEFAULT_NAMESPACE = "default"
ITEM_DOMAIN = "mm-item/v1"
ContentKey = tuple[str | int | bytes, ...]


def pixel_content_key(
    mode: str, size: tuple[int, int], pixels: bytes, palette: bytes | None = None
) -> ContentKey:
    """Content key of a decoded image: its mode, size, palette (mode P) and raw pixel bytes."""
    return ("pixels", mode, size[0], size[1], palette or b"", pixels)


def claimed_content_key(kind: str, namespace: str, value: str) -> ContentKey:
    """Content key of an item named by a caller UUID ("uuid") or an EXIF ImageUniqueID ("exif")."""
    if kind not in ("uuid", "exif"):
        raise ValueError(f"claimed content kind must be 'uuid' or 'exif', got {kind!r}")
    return (kind, namespace, value)


def mm_item_identity(
    hasher: Hasher,
    *,
    model_id: str,
    revision: str,
    processor_fingerprint: Iterable[str | int],
    modality: str,
    content: ContentKey,
    decision: Iterable[int],
    domain: str = ITEM_DOMAIN,
) -> str:
    """Full-width identity digest of one processed multimodal item (see the table above).

    `domain`: ITEM_DOMAIN for items processed here; a disaggregated server's images planned
    for the encoder pool take their own (`processing.remote_planning.REMOTE_ITEM_DOMAIN`)."""
    fingerprint = list(processor_fingerprint)
    decided = list(decision)
    parts: list[bytes | str | int] = [model_id, revision, len(fingerprint), *fingerprint]
    parts += [modality, len(content), *content, len(decided), *decided]
    return hasher.digest(domain, parts)
