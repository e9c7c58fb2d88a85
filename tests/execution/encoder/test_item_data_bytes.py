"""ItemDataStore counts an item by the uint8 levels it holds: a quarter of float32 patches."""

from __future__ import annotations

from mmserve.execution.encoder.pixels import ItemDataStore, held_bytes
from mmserve.multimodal import MultiModalFeature, PlaceholderRange
from mmserve.processing.image_processor import ImageProcessorConfig, process_image
from tests.support.factory import random_image


def test_kept_pixels_are_counted_at_one_byte_per_patch_value() -> None:
    cfg = ImageProcessorConfig()
    images = [process_image(random_image(448, 448, seed=s), cfg) for s in range(4)]
    assert [held_bytes(i) for i in images] == [1024 * 1176] * 4  # float32 would be 4x
    store = ItemDataStore(capacity_bytes=4 * 1024 * 1176)
    features = []
    for k, image in enumerate(images):
        features.append(MultiModalFeature(f"{k}" * 64, "image", PlaceholderRange(k * 300, 256),
                                          image.grid_thw))  # fmt: skip
        store.add("r", {features[-1].identifier: image})
    store.pass_items("r", features, num_computed=4 * 300)
    assert len(store) == 4 and store.used_bytes == 4 * 1024 * 1176 and store.num_evicted == 0
