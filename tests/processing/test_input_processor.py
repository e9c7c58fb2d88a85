"""InputProcessor: chat rendering, placeholder expansion, validation, cache and UUID references."""

from __future__ import annotations

import asyncio
import base64
import io
import warnings
from pathlib import Path

import numpy as np
import pytest

from mmserve.errors import (
    InvalidRequestError,
    PromptTooLongError,
    TooManyItemsError,
    UnknownMediaUUIDError,
)
from mmserve.processing.input_processor import InputProcessor
from tests.support.factory import random_image

PROMPT_2 = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and"
    "<|vision_start|><|image_pad|><|vision_end|>Are the two shapes the same?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture
def processor(tiny_checkpoint: Path) -> InputProcessor:
    return InputProcessor.from_pretrained(
        tiny_checkpoint, max_model_len=4096, mm_processor_cache_gb=0.05
    )


def _hf_expected_ids(model_dir: Path, text: str, images) -> list[int]:
    """transformers as oracle: its tokenizer, its image processor's grids, pads expanded."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = AutoTokenizer.from_pretrained(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grids = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images)["image_grid_thw"]
    for grid in grids:
        n = int(np.prod(grid)) // 4
        text = text.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
    return tok(text.replace("<|placeholder|>", "<|image_pad|>"))["input_ids"]


def test_chat_matches_transformers_template_tokenizer_and_token_counts(
    processor: InputProcessor, tiny_checkpoint: Path
) -> None:
    from transformers import AutoTokenizer

    images = [random_image(100, 80, seed=1), random_image(57, 300, seed=2)]
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": images[0]},
                {"type": "text", "text": "and"},
                {"type": "image", "image": images[1]},
                {"type": "text", "text": "Which image shows a circle?"},
            ],
        },
    ]
    out = processor.process_chat(messages)
    hf_text = AutoTokenizer.from_pretrained(tiny_checkpoint).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert out.prompt == hf_text
    assert out.prompt_token_ids == _hf_expected_ids(tiny_checkpoint, hf_text, images)
    image_id = processor.token_ids.image_token_id
    ids = np.array(out.prompt_token_ids)
    for feature in out.mm_features:
        span = ids[feature.placeholder.offset : feature.placeholder.end]
        assert (span == image_id).all()
        assert ids[feature.placeholder.offset - 1] == processor.token_ids.vision_start_token_id
        assert ids[feature.placeholder.end] == processor.token_ids.vision_end_token_id
        t, h, w = feature.grid_thw
        assert feature.placeholder.length == t * h * w // 4 == feature.num_patches // 4
    assert sum(f.placeholder.length for f in out.mm_features) == int((ids == image_id).sum())
    assert out.mrope_positions.shape == (3, len(ids))
    assert out.mrope_positions.dtype == np.int64
    assert out.mrope_position_delta == int(out.mrope_positions.max()) + 1 - len(ids)


def test_generate_dict_with_per_request_kwargs(processor: InputProcessor, tiny_checkpoint) -> None:
    images = [random_image(400, 300, seed=3), random_image(64, 64, seed=4)]
    request = {"prompt": PROMPT_2, "multi_modal_data": {"image": images}}
    out = processor.process_generate_input(request)
    assert out.prompt_token_ids == _hf_expected_ids(tiny_checkpoint, PROMPT_2, images)
    small = processor.process_generate_input(
        {**request, "mm_processor_kwargs": {"max_pixels": 100 * 100}}
    )
    assert small.mm_features[0].placeholder.length < out.mm_features[0].placeholder.length
    assert small.mm_features[0].identifier != out.mm_features[0].identifier
    assert small.mm_features[1].identifier == out.mm_features[1].identifier  # cap did not bite
    with pytest.raises(InvalidRequestError, match="patch_size"):
        processor.process_generate_input({**request, "mm_processor_kwargs": {"patch_size": 16}})


def test_typed_vision_tokens_in_user_text_are_refused(processor: InputProcessor) -> None:
    for text in ("look: <|image_pad|>", "<|vision_start|>", "x<|video_pad|>", "<|vision_end|>"):
        with pytest.raises(InvalidRequestError, match="reserved token"):
            processor.process_chat([{"role": "user", "content": text}])
        with pytest.raises(InvalidRequestError, match="reserved token"):
            processor.process_chat([{"role": "user", "content": [{"type": "text", "text": text}]}])
    with pytest.raises(InvalidRequestError, match="role"):
        processor.process_chat([{"role": "<|im_start|>", "content": "hi"}])


def test_marker_and_image_counts_must_agree(processor: InputProcessor) -> None:
    image = random_image(50, 50)
    with pytest.raises(InvalidRequestError, match="2 image marker.*1 image"):
        processor.process(PROMPT_2, [image])
    with pytest.raises(InvalidRequestError, match="0 image marker.*1 image"):
        processor.process("no markers here", [image])
    with pytest.raises(InvalidRequestError, match="1 image marker.*0 image"):
        processor.process("typed <|image_pad|> alone")
    with pytest.raises(InvalidRequestError, match="must appear as"):
        processor.process("<|image_pad|><|vision_end|>", [image])
    with pytest.raises(InvalidRequestError, match="do not wrap"):
        processor.process("<|vision_start|> stray")
    with pytest.raises(InvalidRequestError, match="1 video marker.*0 video"):
        processor.process("<|vision_start|><|video_pad|><|vision_end|>")


def test_limits_are_refused_naming_the_flag(tiny_checkpoint: Path) -> None:
    proc = InputProcessor.from_pretrained(
        tiny_checkpoint, max_model_len=200, limit_mm_per_prompt={"image": 1}
    )
    two = [random_image(40, 40), random_image(40, 40)]
    with pytest.raises(TooManyItemsError, match="--limit-mm-per-prompt"):
        proc.process(PROMPT_2, two)
    one = "<|vision_start|><|image_pad|><|vision_end|>describe"
    with pytest.raises(PromptTooLongError, match="--max-model-len 200"):
        proc.process(one, [random_image(1000, 1000)])
    assert proc.cache.stats.queries == 0  # refused from sizes alone, before any pixel work
    assert len(proc.process(one, [random_image(100, 100)]).prompt_token_ids) <= 200


def test_repeated_image_hits_the_processor_cache(processor: InputProcessor) -> None:
    image = random_image(120, 90, seed=5)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>describe"
    first = processor.process(prompt, [image])
    second = processor.process(prompt, [image.copy()])
    assert first.mm_features[0].identifier == second.mm_features[0].identifier
    identifier = first.mm_features[0].identifier
    assert second.mm_data[identifier] is first.mm_data[identifier]
    assert (processor.cache.stats.queries, processor.cache.stats.hits) == (2, 1)


def test_uuid_only_items_resolve_inside_their_namespace_while_cached(
    processor: InputProcessor,
) -> None:
    image = random_image(300, 200, seed=6)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>describe"
    sent = processor.process(prompt, [image], multi_modal_uuids=["cat"], namespace="key-a")
    again = processor.process(prompt, [None], multi_modal_uuids=["cat"], namespace="key-a")
    assert again.prompt_token_ids == sent.prompt_token_ids
    assert again.mm_features[0].identifier == sent.mm_features[0].identifier
    identifier = sent.mm_features[0].identifier
    assert again.mm_data[identifier] is sent.mm_data[identifier]
    # A cap above the image's size changes nothing, so the reference still resolves.
    big_cap = processor.process(
        prompt,
        [None],
        multi_modal_uuids=["cat"],
        namespace="key-a",
        mm_processor_kwargs={"max_pixels": 4000 * 4000},
    )
    assert big_cap.mm_features[0].identifier == sent.mm_features[0].identifier
    with pytest.raises(UnknownMediaUUIDError, match="send the image again"):
        processor.process(prompt, [None], multi_modal_uuids=["cat"], namespace="key-b")
    with pytest.raises(UnknownMediaUUIDError, match="send the image again"):
        processor.process(
            prompt,
            [None],
            multi_modal_uuids=["cat"],
            namespace="key-a",
            mm_processor_kwargs={"max_pixels": 100 * 100},
        )


def test_uuid_reference_fails_when_the_cache_is_disabled(tiny_checkpoint: Path) -> None:
    proc = InputProcessor.from_pretrained(tiny_checkpoint, mm_processor_cache_gb=0)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>"
    proc.process(prompt, [random_image(60, 60)], multi_modal_uuids=["u1"])
    with pytest.raises(UnknownMediaUUIDError):
        proc.process(prompt, [None], multi_modal_uuids=["u1"])


def test_http_chat_with_data_url_and_uuid_only_part(processor: InputProcessor) -> None:
    image = random_image(90, 70, seed=7)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    def messages(image_url: dict) -> list[dict]:
        parts = [{"type": "image_url", "image_url": image_url}, {"type": "text", "text": "hi"}]
        return [{"role": "user", "content": parts}]

    def messages_with_pil(img) -> list[dict]:
        parts = [{"type": "image", "image": img}, {"type": "text", "text": "hi"}]
        return [{"role": "user", "content": parts}]

    first = asyncio.run(
        processor.aprocess_chat(messages({"url": url, "uuid": "u-7"}), namespace="api-key-1")
    )
    offline = processor.process_chat(messages_with_pil(image))
    assert first.prompt_token_ids == offline.prompt_token_ids  # HTTP and offline paths agree
    by_uuid = asyncio.run(processor.aprocess_chat(messages({"uuid": "u-7"}), namespace="api-key-1"))
    assert by_uuid.prompt_token_ids == first.prompt_token_ids
    assert by_uuid.mm_features[0].identifier == first.mm_features[0].identifier
    with pytest.raises(InvalidRequestError, match="needs a url"):
        processor.process_chat(messages({}))


def test_max_tokens_per_mm_item_follows_the_server_wide_cap(tiny_checkpoint: Path) -> None:
    proc = InputProcessor.from_pretrained(
        tiny_checkpoint,
        mm_processor_kwargs={"max_pixels": 1280 * 28 * 28},
        limit_mm_per_prompt={"video": 0},  # videos refused: images alone set the bound
    )
    assert proc.max_tokens_per_mm_item == 1280
    assert proc.max_patches_per_mm_item == 1280 * 4
    with pytest.raises(InvalidRequestError, match="temporal_patch_size"):
        InputProcessor.from_pretrained(
            tiny_checkpoint, mm_processor_kwargs={"temporal_patch_size": 1}
        )


def test_processing_never_imports_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, mmserve.processing.input_processor, mmserve.processing.media; "
        "assert 'torch' not in sys.modules, 'processing imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_offline_uuids_are_bounded_and_checked(processor: InputProcessor) -> None:
    prompt = "<|vision_start|><|image_pad|><|vision_end|>describe"
    image = random_image(60, 60, seed=9)

    def generate(uuids: object) -> None:
        processor.process_generate_input(
            {"prompt": prompt, "multi_modal_data": {"image": image}, "multi_modal_uuids": uuids}
        )

    generate({"image": "k" * 256})
    generate({"image": ["k2"]})
    for bad, why in [
        ({"image": "k" * 257}, "at most 256"),
        ({"image": [""]}, "non-empty"),
        ({"image": ["tab\there"]}, "printable"),
        ({"image": 5}, "list of uuids"),
        ({"audio": ["v"]}, "must look like"),
        (["k"], "must look like"),
        ({"video": ["v"]}, "1 video entries but 0 videos"),
    ]:
        with pytest.raises(InvalidRequestError, match=why) as info:
            generate(bad)
        assert info.value.param == "multi_modal_uuids"
