"""Item identity: by decoded content and effective processing, claims only inside a namespace."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from mmserve.hashing import Hasher
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.item_resolver import ItemResolver
from mmserve.processing.media import MediaLoader
from mmserve.processing.modalities import ProcessingConfig
from mmserve.processing.processor_cache import ProcessorCache
from tests.support.factory import random_image

CFG = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=16384 * 28 * 28)


def _identity(
    image: Image.Image,
    *,
    cfg: ImageProcessorConfig = CFG,
    uuid: str | None = None,
    namespace: str = "default",
    algorithm: str = "blake3",
    model_id: str = "qwen2-vl-tiny",
    trust_exif_image_id: bool = False,
) -> str:
    resolver = ItemResolver(
        Hasher(algorithm),
        ProcessorCache(0),
        model_id=model_id,
        trust_exif_image_id=trust_exif_image_id,
    )
    pcfg = ProcessingConfig(cfg)
    return resolver.identifier(resolver.plan(image, uuid, pcfg, namespace), pcfg, namespace)


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def test_same_pixels_in_png_and_lossless_webp_give_one_id() -> None:
    image = random_image(64, 48, seed=1)
    loader = MediaLoader()
    from_png = loader.load_image(_encode(image, "PNG"))
    from_webp = loader.load_image(_encode(image, "WEBP", lossless=True))
    assert _identity(from_png) == _identity(from_webp)
    from_jpeg = loader.load_image(_encode(image, "JPEG", quality=90))
    assert _identity(from_jpeg) != _identity(from_png)


def test_same_bytes_with_another_size_or_mode_give_other_ids() -> None:
    raw = random_image(6, 4, seed=2).tobytes()  # 72 bytes
    base = Image.frombytes("RGB", (6, 4), raw)
    other_size = Image.frombytes("RGB", (4, 6), raw)
    other_mode = Image.frombytes("YCbCr", (6, 4), raw)
    ids = {_identity(base), _identity(other_size), _identity(other_mode)}
    assert len(ids) == 3


def test_a_cap_that_changes_nothing_keeps_the_id_and_one_that_bites_changes_it() -> None:
    image = random_image(300, 200, seed=3)
    plain = _identity(image)
    assert _identity(image, cfg=CFG.with_overrides({"max_pixels": 2000 * 2000})) == plain
    assert _identity(image, cfg=CFG.with_overrides({"max_pixels": 100 * 100})) != plain


def test_caller_uuid_stands_in_for_content_only_inside_its_namespace() -> None:
    a, b = random_image(40, 40, seed=4), random_image(40, 40, seed=5)
    assert _identity(a, uuid="img-1", namespace="k1") == _identity(b, uuid="img-1", namespace="k1")
    assert _identity(a, uuid="img-1", namespace="k1") != _identity(a, uuid="img-1", namespace="k2")
    assert _identity(a, uuid="img-1", namespace="k1") != _identity(a)


def _with_exif_id(image: Image.Image, image_id: str) -> Image.Image:
    exif = Image.Exif()
    exif[0xA420] = image_id
    data = _encode(image, "JPEG", exif=exif.tobytes())
    return MediaLoader().load_image(data)


EXIF_ID = "0123456789abcdef0123456789abcdef"


def test_exif_image_id_is_not_an_identity_by_default() -> None:
    a = _with_exif_id(random_image(40, 40, seed=6), EXIF_ID)
    b = _with_exif_id(random_image(40, 40, seed=7), EXIF_ID)
    assert a.info.get("exif")  # the id survived decoding: it is ignored, not lost
    assert _identity(a) != _identity(b)
    assert _identity(a, namespace="k1") != _identity(b, namespace="k1")
    # without the claim, the same pixels are the same image, with or without EXIF
    plain = MediaLoader().load_image(_encode(Image.frombytes("RGB", a.size, a.tobytes()), "PNG"))
    assert _identity(plain) == _identity(a)


def test_trusted_exif_image_id_stands_in_for_content_only_inside_a_namespace() -> None:
    a = _with_exif_id(random_image(40, 40, seed=6), EXIF_ID)
    b = _with_exif_id(random_image(40, 40, seed=7), EXIF_ID)
    trusted = {"trust_exif_image_id": True}
    assert _identity(a, namespace="k1", **trusted) == _identity(b, namespace="k1", **trusted)
    assert _identity(a, namespace="k1", **trusted) != _identity(b, namespace="k2", **trusted)
    assert _identity(a, namespace="k1", **trusted) != _identity(a, namespace="k1")


def test_model_and_algorithm_are_part_of_the_id_and_ids_are_full_width() -> None:
    image = random_image(30, 30, seed=8)
    blake = _identity(image)
    sha = _identity(image, algorithm="sha256")
    assert len(blake) == 64 and len(sha) == 64 and blake != sha
    assert _identity(image, model_id="other-model") != blake


def test_hasher_frames_parts_so_different_splits_never_collide() -> None:
    h = Hasher()
    assert h.digest("d", ["ab", "c"]) != h.digest("d", ["a", "bc"])
    assert h.digest("d", [b"1"]) != h.digest("d", ["1"]) != h.digest("d", [1])
    assert h.digest("d1", ["x"]) != h.digest("d2", ["x"])
    with pytest.raises(ValueError, match="not supported"):
        Hasher("md5")
