"""One multimodal item -> its processing decision, identity and processed data (cache first)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidRequestError, UnknownMediaUUIDError
from mmserve.hashing import ContentKey, Hasher, claimed_content_key, mm_item_identity
from mmserve.multimodal import EncoderInput, RemoteItem
from mmserve.processing.modalities import (
    EXIF_IMAGE_UNIQUE_ID,
    EXIF_SUB_IFD,
    Modality,
    Planned,
    ProcessingConfig,
    default_modalities,
    exif_image_id,
)
from mmserve.processing.processor_cache import ProcessorCache, UUIDIndex
from mmserve.processing.resent_images import (
    EncodedImage,
    ResentImageEvicted,
    ResentImages,
    SourcedImage,
)

__all__ = ["EXIF_IMAGE_UNIQUE_ID", "EXIF_SUB_IFD", "ItemPlan", "ItemResolver", "exif_image_id"]


@dataclass(frozen=True, slots=True)
class ItemPlan:
    """What processing will do to an item, known from its size alone (no pixels touched)."""

    modality: Modality
    # the decoded item, an EncodedImage (bytes decoded before), or None (a UUID-only reference)
    item: Any
    uuid: str | None
    record: object
    planned: Planned
    source_digest: str | None = None  # of the bytes a freshly decoded image came from

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return self.planned.grid_thw

    @property
    def num_tokens(self) -> int:
        return self.planned.num_tokens


@dataclass(frozen=True, slots=True)
class ResolvedItem:
    identifier: str
    modality: str
    data: EncoderInput | RemoteItem
    grid_thw: tuple[int, int, int]
    num_tokens: int


def _unknown_uuid(modality: str, uuid: str) -> UnknownMediaUUIDError:
    return UnknownMediaUUIDError(
        f"{modality} uuid {uuid!r} is not known to this server (or its processed data was "
        f"evicted); send the {modality} again together with its uuid",
        param="multi_modal_uuids",
    )


class ItemResolver:
    """Plans items from their size, then hashes, looks up the processor cache and processes.

    `trust_exif_image_id`: let an image's EXIF ImageUniqueID stand in for its pixels (inside
    the caller's namespace). Off by default: EXIF travels with the file, whoever made it, so
    two different pictures may carry the same id; only the pixels then name an image.
    """

    def __init__(
        self,
        hasher: Hasher,
        cache: ProcessorCache,
        *,
        model_id: str,
        revision: str = "",
        uuid_index: UUIDIndex | None = None,
        trust_exif_image_id: bool = False,
        modalities: dict[str, Modality] | None = None,
        resent: ResentImages | None = None,
    ) -> None:
        """`resent`: where a decoded image's identity is remembered for its bytes, and from
        where an `EncodedImage` came (processing/resent_images.py)."""
        self.hasher = hasher
        self.resent = resent
        self.trust_exif_image_id = trust_exif_image_id
        self.cache = cache
        self.model_id = model_id
        self.revision = revision
        self.uuid_index = uuid_index or UUIDIndex()
        self.modalities = modalities or default_modalities(trust_exif_image_id=trust_exif_image_id)

    def plan(
        self,
        item: Any,
        uuid: str | None,
        cfg: ProcessingConfig,
        namespace: str,
        modality: str = "image",
    ) -> ItemPlan:
        kind = self.modalities[modality]
        digest = None
        if isinstance(item, SourcedImage):
            item, digest = item.image, item.digest
        if item is None:
            if uuid is None:
                raise InvalidRequestError(f"a {modality} item has neither data nor a uuid")
            record = self.uuid_index.lookup(namespace, uuid)
            # a uuid sent before for another modality names nothing of this one
            if record is None or not isinstance(record, kind.record_type):
                raise _unknown_uuid(modality, uuid)
        elif isinstance(item, EncodedImage):
            record = item.record  # what the first decode of these bytes found
        else:
            record = kind.record(item)
        return ItemPlan(kind, item, uuid, record, kind.plan(record, cfg), digest)

    def identifier(self, plan: ItemPlan, cfg: ProcessingConfig, namespace: str) -> str:
        if isinstance(plan.item, EncodedImage):
            return plan.item.identifier  # what the pixels of these bytes were named
        return mm_item_identity(
            self.hasher,
            model_id=self.model_id,
            revision=self.revision,
            processor_fingerprint=plan.modality.fingerprint(cfg),
            modality=plan.modality.name,
            content=self._content_key(plan, namespace),
            decision=plan.planned.decision,
            domain=plan.planned.domain,
        )

    def resolve(self, plan: ItemPlan, cfg: ProcessingConfig, namespace: str) -> ResolvedItem:
        identifier = self.identifier(plan, cfg, namespace)
        name = plan.modality.name
        data = self.cache.get(identifier)
        if data is None:
            if plan.item is None:
                raise _unknown_uuid(name, plan.uuid or "")
            if isinstance(plan.item, EncodedImage):
                raise ResentImageEvicted(identifier)
            data = plan.modality.process(plan.item, plan.planned, cfg)
            assert data.grid_thw == plan.grid_thw, (data.grid_thw, plan.grid_thw)
            self.cache.put(identifier, data)
        if plan.source_digest is not None and self.resent is not None and plan.uuid is None:
            self.resent.remember(namespace, plan.source_digest, cfg, plan.record, identifier)
        if plan.uuid is not None and plan.item is not None:
            self.uuid_index.remember(namespace, plan.uuid, plan.record)
        return ResolvedItem(identifier, name, data, plan.grid_thw, plan.num_tokens)

    def _content_key(self, plan: ItemPlan, namespace: str) -> ContentKey:
        if plan.uuid is not None:
            return claimed_content_key("uuid", namespace, plan.uuid)
        assert plan.item is not None
        return plan.modality.content_key(plan.item, namespace)
