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

import threading
from collections import OrderedDict
from dataclasses import dataclass

from mmserve.hashing import Hasher
from mmserve.processing.modalities import ProcessingConfig
from mmserve.processing.processor_cache import UUIDRecord

# What the memo remembers at most: an entry (key, record, identity) is under 1 KiB, so ~12 MiB
# at most, for more images than the default processor cache holds.
MAX_ENTRIES = 16_384
SOURCE_DOMAIN = "mm-source/v1"


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
    identity).

    Bounded (least recently used leaves first); thread-safe (requests are processed on
    worker threads).
    """

    def __init__(self, hasher: Hasher, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be > 0, got {max_entries}")
        self.hasher = hasher
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[UUIDRecord, str]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def digest(self, data: bytes) -> str:
        return self.hasher.digest(SOURCE_DOMAIN, [data])

    def lookup(
        self, namespace: str, digest: str, cfg: ProcessingConfig
    ) -> tuple[UUIDRecord, str] | None:
        """(record, identifier) of these bytes under this namespace and these settings."""
        key = (namespace, digest, cfg.image)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def remember(
        self,
        namespace: str,
        digest: str,
        cfg: ProcessingConfig,
        record: UUIDRecord,
        identifier: str,
    ) -> None:
        key = (namespace, digest, cfg.image)
        with self._lock:
            self._entries[key] = (record, identifier)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
