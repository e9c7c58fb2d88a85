"""Remote mode of the input processor, http(s) images: the UrlPlanner's answers, refusals and
unavailability (fallback to the local path, or a 503), on the offline and the HTTP path; and
uuids, the processor cache and item limits for remote images."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest

from mmserve.errors import (
    EncoderUnavailableError,
    MediaFetchRefusedError,
    TooManyItemsError,
    UnknownMediaUUIDError,
)
from mmserve.multimodal import ProcessedPrompt, RemoteItem
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.remote_planning import RemoteImagePlanning
from tests.processing.remote_helpers import (
    CAT_URL,
    ONE_IMAGE,
    PAGES,
    FakePlanner,
    chat,
    data_url,
    encoded,
    make_planner,
    make_processor,
    same_plan,
)
from tests.support.factory import random_image


@pytest.fixture
def fresh_planner(planner: FakePlanner) -> Iterator[FakePlanner]:
    planner.mode = "answer"
    planner.calls.clear()
    yield planner
    planner.mode = "answer"


# ----------------------------------------------------------------------------- URLs


def test_a_planned_url_is_sent_as_a_reference(
    remote: InputProcessor, fresh_planner: FakePlanner, no_decoding: None
) -> None:
    kwargs = {"max_pixels": 5000}
    got = remote.process_chat(chat(CAT_URL), mm_processor_kwargs=kwargs)
    cfg = remote.request_config(kwargs).image
    assert fresh_planner.calls == [(CAT_URL, cfg.min_pixels, cfg.max_pixels)]
    item = got.mm_data[got.mm_features[0].identifier]
    assert isinstance(item, RemoteItem)
    assert (item.source, item.payload, item.url) == ("url", None, CAT_URL)
    assert item.content_digest == blake3.blake3(PAGES[CAT_URL]).hexdigest()
    inline = remote.process_chat(chat(data_url(PAGES[CAT_URL])), mm_processor_kwargs=kwargs)
    assert got.mm_features[0].identifier == inline.mm_features[0].identifier  # the same bytes
    assert got.prompt_token_ids == inline.prompt_token_ids
    asynchronous = asyncio.run(remote.aprocess_chat(chat(CAT_URL), mm_processor_kwargs=kwargs))
    assert asynchronous.mm_features[0].identifier == got.mm_features[0].identifier

    async def sync_call_inside_a_running_loop() -> ProcessedPrompt:
        return remote.process_generate_input(
            {
                "prompt": ONE_IMAGE,
                "multi_modal_data": {"image": CAT_URL},
                "mm_processor_kwargs": kwargs,
            }
        )

    offline = asyncio.run(sync_call_inside_a_running_loop())
    assert offline.mm_features[0].identifier == got.mm_features[0].identifier


def test_a_url_the_pool_refuses_fails_with_its_400(
    remote: InputProcessor, fresh_planner: FakePlanner
) -> None:
    fresh_planner.mode = "refuse"
    with pytest.raises(MediaFetchRefusedError, match="host is not allowed") as info:
        asyncio.run(remote.aprocess_chat(chat(CAT_URL)))
    assert info.value.status_code == 400 and info.value.param == "image_url"


@pytest.mark.parametrize("mode", ["unavailable", "wrong_grid"])
def test_an_unavailable_pool_falls_back_to_the_local_path(
    mode: str, remote: InputProcessor, local: InputProcessor, fresh_planner: FakePlanner
) -> None:
    fresh_planner.mode = mode
    got = asyncio.run(remote.aprocess_chat(chat(CAT_URL)))
    offline = remote.process_chat(chat(CAT_URL))
    want = local.process_chat(chat(data_url(PAGES[CAT_URL])))
    for prompt in (got, offline):
        same_plan(prompt, want)
        assert prompt.mm_features[0].identifier == want.mm_features[0].identifier  # pixels


@pytest.mark.parametrize("mode", ["unavailable", "wrong_grid"])
def test_an_unavailable_pool_without_fallback_is_a_503(
    mode: str, qwen2_vl_dir: Path, media_root: Path
) -> None:
    planner = make_planner(qwen2_vl_dir)
    planner.mode = mode
    proc = make_processor(qwen2_vl_dir, media_root, None)
    strict = InputProcessor(
        proc.tokenizer,
        proc.image_config,
        proc.token_ids,
        max_model_len=8192,
        media_loader=proc.media_loader,
        remote_images=RemoteImagePlanning(planner, fallback_local=False),
    )
    for run in (
        lambda: asyncio.run(strict.aprocess_chat(chat(CAT_URL))),
        lambda: strict.process_chat(chat(CAT_URL)),
    ):
        with pytest.raises(EncoderUnavailableError, match="--encoder-fallback fail") as info:
            run()
        assert info.value.status_code == 503
    proc.media_loader.close()


# ---------------------------------------------------------------- uuids, cache, limits


def test_uuid_references_to_remote_images_resolve_to_the_same_identity(
    remote: InputProcessor, fresh_planner: FakePlanner
) -> None:
    png = encoded(random_image(300, 200, seed=50))
    sent = remote.process_generate_input(
        {
            "prompt": ONE_IMAGE,
            "multi_modal_data": {"image": png},
            "multi_modal_uuids": {"image": "cat"},
        },
        namespace="key-a",
    )
    again = remote.process(ONE_IMAGE, [None], multi_modal_uuids=["cat"], namespace="key-a")
    assert again.mm_features[0].identifier == sent.mm_features[0].identifier
    identifier = sent.mm_features[0].identifier
    assert again.mm_data[identifier] is sent.mm_data[identifier]
    assert isinstance(again.mm_data[identifier], RemoteItem)
    big_cap = {"max_pixels": 4000 * 4000}
    same = remote.process(
        ONE_IMAGE, [None], multi_modal_uuids=["cat"], namespace="key-a", mm_processor_kwargs=big_cap
    )
    assert same.mm_features[0].identifier == sent.mm_features[0].identifier
    with pytest.raises(UnknownMediaUUIDError, match="send the image again"):
        remote.process(ONE_IMAGE, [None], multi_modal_uuids=["cat"], namespace="key-b")
    with pytest.raises(UnknownMediaUUIDError, match="send the image again"):
        remote.process(
            ONE_IMAGE,
            [None],
            multi_modal_uuids=["cat"],
            namespace="key-a",
            mm_processor_kwargs={"max_pixels": 100 * 100},
        )
    # Over HTTP: a URL planned by the pool, then referenced by its uuid alone.
    first = asyncio.run(remote.aprocess_chat(chat(CAT_URL, uuids=("u-7",)), namespace="api-key-1"))
    by_uuid = asyncio.run(
        remote.aprocess_chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"uuid": "u-7"}}]}],
            namespace="api-key-1",
        )
    )
    assert by_uuid.mm_features[0].identifier == first.mm_features[0].identifier
    assert len(fresh_planner.calls) == 1
    remote.cache.check_integrity()


def test_item_limits_come_before_any_plan(qwen2_vl_dir: Path, media_root: Path) -> None:
    planner = make_planner(qwen2_vl_dir)
    proc = make_processor(qwen2_vl_dir, media_root, planner)
    limited = InputProcessor(
        proc.tokenizer,
        proc.image_config,
        proc.token_ids,
        max_model_len=8192,
        limit_mm_per_prompt={"image": 1},
        media_loader=proc.media_loader,
        remote_images=RemoteImagePlanning(planner),
    )
    with pytest.raises(TooManyItemsError):
        asyncio.run(limited.aprocess_chat(chat(CAT_URL, CAT_URL)))
    assert planner.calls == []
    proc.media_loader.close()
