"""One image item -> its processing decision, identity and processed data (cache first)."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from mmserve.errors import InvalidRequestError, UnknownMediaUUIDError
from mmserve.hashing import (
    ContentKey,
    Hasher,
    claimed_content_key,
    mm_item_identity,
    pixel_content_key,
)
from mmserve.multimodal import ProcessedImage
from mmserve.processing.image_processor import ImageProcessorConfig, get_grid_thw, process_image
from mmserve.processing.processor_cache import ProcessorCache, UUIDIndex, UUIDRecord

EXIF_IMAGE_UNIQUE_ID = 0xA420
EXIF_SUB_IFD = 0x8769


def exif_image_id(image: Image.Image) -> str | None:
    """The EXIF ImageUniqueID (tag 0xA420) of an image, if it carries a non-empty one."""
    try:
        exif = image.getexif()
        value = exif.get(EXIF_IMAGE_UNIQUE_ID) or exif.get_ifd(EXIF_SUB_IFD).get(
            EXIF_IMAGE_UNIQUE_ID
        )
    except Exception:  # noqa: BLE001 - a malformed EXIF block just means "no claimed id"
        return None
    if isinstance(value, bytes):
        value = value.decode("ascii", errors="replace")
    if isinstance(value, str) and value.strip("\x00 "):
        return value.strip("\x00 ")
    return None


@dataclass(frozen=True, slots=True)
class ItemPlan:
    """What processing will do to an item, known from its size alone (no pixels touched)."""

    image: Image.Image | None
    uuid: str | None
    record: UUIDRecord
    grid_thw: tuple[int, int, int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ResolvedItem:
    identity: str
    data: ProcessedImage
    grid_thw: tuple[int, int, int]
    num_tokens: int


def _unknown_uuid(uuid: str) -> UnknownMediaUUIDError:
    return UnknownMediaUUIDError(
        f"image uuid {uuid!r} is not known to this server (or its processed data was evicted); "
        "send the image again together with its uuid",
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
    ) -> None:
        self.hasher = hasher
        self.trust_exif_image_id = trust_exif_image_id
        self.cache = cache
        self.model_id = model_id
        self.revision = revision
        self.uuid_index = uuid_index or UUIDIndex()

    def plan(
        self, image: Image.Image | None, uuid: str | None, cfg: ImageProcessorConfig, namespace: str
    ) -> ItemPlan:
        if image is None:
            if uuid is None:
                raise InvalidRequestError("an image item has neither image data nor a uuid")
            record = self.uuid_index.lookup(namespace, uuid)
            if record is None:
                raise _unknown_uuid(uuid)
        else:
            record = UUIDRecord(width=image.width, height=image.height, mode=image.mode)
        grid = get_grid_thw(record.width, record.height, cfg)
        num_tokens = grid[0] * grid[1] * grid[2] // cfg.merge_size**2
        return ItemPlan(image, uuid, record, grid, num_tokens)

    def identity(self, plan: ItemPlan, cfg: ImageProcessorConfig, namespace: str) -> str:
        t, h, w = plan.grid_thw
        decision = (h * cfg.patch_size, w * cfg.patch_size, t, h, w)
        return mm_item_identity(
            self.hasher,
            model_id=self.model_id,
            revision=self.revision,
            processor_fingerprint=cfg.fingerprint(),
            modality="image",
            content=self._content_key(plan, namespace),
            decision=decision,
        )

    def resolve(self, plan: ItemPlan, cfg: ImageProcessorConfig, namespace: str) -> ResolvedItem:
        identity = self.identity(plan, cfg, namespace)
        data = self.cache.get(identity)
        if data is None:
            if plan.image is None:
                raise _unknown_uuid(plan.uuid or "")
            data = process_image(plan.image, cfg)
            assert data.grid_thw == plan.grid_thw, (data.grid_thw, plan.grid_thw)
            self.cache.put(identity, data)
        if plan.uuid is not None and plan.image is not None:
            self.uuid_index.remember(namespace, plan.uuid, plan.record)
        return ResolvedItem(identity, data, plan.grid_thw, plan.num_tokens)

    def _content_key(self, plan: ItemPlan, namespace: str) -> ContentKey:
        if plan.uuid is not None:
            return claimed_content_key("uuid", namespace, plan.uuid)
        image = plan.image
        assert image is not None
        exif_id = exif_image_id(image) if self.trust_exif_image_id else None
        if exif_id is not None:
            return claimed_content_key("exif", namespace, exif_id)
        palette = image.getpalette() if image.mode == "P" else None
        return pixel_content_key(
            image.mode, image.size, image.tobytes(), bytes(palette) if palette else None
        )
