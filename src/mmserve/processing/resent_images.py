"""Images sent again byte for byte: named and planned from their first decode, not decoded again.

An agent resends every earlier screenshot with each turn; a chat client resends the whole
conversation. The same encoded bytes always decode to the same pixels, so what the first
decode established (the image's size and mode, and the identity of its processed form under
the request's namespace and processor settings) holds for every later copy. A later copy is
then only hashed: if its processed form is still in the processor cache, no worker decodes
it, no pixel is hashed, and nothing is normalised again. If that form has been evicted, the
bytes are decoded as any new image would be (`ResentImageEvicted`).

Safe by construction: the key is a full-width digest of the bytes (the server's hash
algorithm) with the namespace and every image processor setting (the resize bounds too: they
decide the grid, which the identity covers), so two different images, or one image under two
namespaces or two settings, never share an entry; the value is the identity the first decode
computed from the pixels, which every copy would compute again.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.hashing import Hasher
from mmserve.processing.modalities import ProcessingConfig
from mmserve.processing.processor_cache import UUIDIndex, UUIDRecord

# The memo's budget, counted as the uuid index counts (namespace, key, a fixed overhead):
# ~550 bytes an entry, so about 15,000 files.
RESENT_INDEX_BYTES = 8 << 20
SOURCE_DOMAIN = "mm-source/v1"
SETTINGS_DOMAIN = "mm-source-settings/v1"


@dataclass(frozen=True, slots=True)
class SourcedImage:
    """A decoded image with the digest of the bytes it came from (what the memo learns from)."""

    image: object  # PIL.Image.Image
    digest: str


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """Bytes this server decoded before: planned from `record` and named `identifier` (as that
    decode found), decoded again only if the processed form has left the cache."""

    data: bytes
    digest: str
    record: UUIDRecord
    identifier: str


class ResentImageEvicted(Exception):
    """A resent image's processed form is no longer cached: decode it and process again."""


class ResentImages:
    """The memo: (namespace, digest of the bytes, image processor settings) -> (record,
    identity), kept in a `UUIDIndex` (LRU, bounded in bytes, thread-safe) under a key that
    digests the bytes and every setting.
    """

    def __init__(self, hasher: Hasher, capacity_bytes: int = RESENT_INDEX_BYTES) -> None:
        self.hasher = hasher
        self._index = UUIDIndex(capacity_bytes)

    def __len__(self) -> int:
        return len(self._index)

    def digest(self, data: bytes) -> str:
        return self.hasher.digest(SOURCE_DOMAIN, [data])

    def entry_bytes(self, namespace: str) -> int:
        """What one entry costs the budget (every key has the same length)."""
        return UUIDIndex.entry_bytes(namespace, "0" * (2 * len(self.digest(b"")) + 1))

    def lookup(
        self, namespace: str, digest: str, cfg: ProcessingConfig
    ) -> tuple[UUIDRecord, str] | None:
        """(record, identifier) of these bytes under this namespace and these settings."""
        return self._index.lookup(namespace, self._key(digest, cfg))  # type: ignore[return-value]

    def remember(
        self,
        namespace: str,
        digest: str,
        cfg: ProcessingConfig,
        record: UUIDRecord,
        identifier: str,
    ) -> None:
        self._index.remember(namespace, self._key(digest, cfg), (record, identifier))

    def _key(self, digest: str, cfg: ProcessingConfig) -> str:
        # the whole image config (frozen dataclass: its repr lists every field, floats exactly)
        return f"{digest}/{self.hasher.digest(SETTINGS_DOMAIN, [repr(cfg.image)])}"
