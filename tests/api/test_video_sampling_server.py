"""Per-request video sampling through a real server and the openai client: fps above the
engine's rate is sampled as asked (mm_processor_kwargs or vLLM's media_io_kwargs), the frames
stay capped by max_frames, --max-video-fps bounds the rate, and bad values are a 400 naming
their field. Frame counts are read from usage.prompt_tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from mmserve.config.model import bundled_toy_model_dir
from tests.support.factory import video_bytes
from tests.support.harness import Server, data_url, read_metrics

MODEL = "mmserve-toy"
# 32x32 frames resize to 56x56: 2x2 merged tokens per temporal patch (two frames)
SMALL = {"min_pixels": 3136, "max_pixels": 3136}
TOKENS_PER_PATCH = 4
CLIP = data_url(video_bytes(16, 32, 32, fps=8, seed=7), "video/mp4")  # 2 s, 16 frames
MAX_FPS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("video-sampling") / "server.log"
    srv = Server(bundled_toy_model_dir(), log, "--max-video-fps", str(MAX_FPS))
    yield srv
    srv.stop()


def _messages(url: str = CLIP) -> list[dict]:
    parts = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What?"}]
    return [{"role": "user", "content": parts}]


def _prompt_tokens(server: Server, mm: dict | None = None, io: dict | None = None) -> int:
    extra: dict = {"mm_processor_kwargs": {**SMALL, **(mm or {})}}
    if io is not None:
        extra["media_io_kwargs"] = io
    resp = server.client.chat.completions.create(
        model=MODEL, messages=_messages(), max_tokens=1, temperature=0, extra_body=extra
    )
    return resp.usage.prompt_tokens


def test_fps_above_the_engine_rate_is_sampled_as_asked(server: Server) -> None:
    one_patch = _prompt_tokens(server, io={"video": {"num_frames": 2}})
    text = one_patch - TOKENS_PER_PATCH

    def patches(mm: dict | None = None, io: dict | None = None) -> float:
        return (_prompt_tokens(server, mm, io) - text) / TOKENS_PER_PATCH

    assert patches() == 2  # the engine's 2 fps: 4 frames of 2 s
    assert patches({"fps": 4}) == 4  # 8 frames: above the engine's rate, accepted
    assert patches(io={"video": {"fps": 4}}) == 4  # vLLM's spelling, the same frames
    assert patches({"fps": MAX_FPS}) == 8  # at the ceiling: all 16 frames
    assert patches({"fps": MAX_FPS, "max_frames": 10}) == 5  # capped by max_frames
    assert patches(io={"video": {"num_frames": 12}}) == 6
    assert patches({"num_frames": 12}) == 6


def test_same_video_other_fps_is_another_item_and_same_fps_a_cache_hit(server: Server) -> None:
    def hits() -> float:
        return sum(v for k, v in read_metrics(server.url).items() if "processor_cache_hits" in k)

    slow = _prompt_tokens(server, {"fps": 1})
    before = hits()
    fast = _prompt_tokens(server, {"fps": 3})
    assert fast > slow and hits() == before  # fps 3: 6 frames, not fps 1's 4
    again = _prompt_tokens(server, {"fps": 3})
    assert again == fast and hits() == before + 1


def _refusal(server: Server, body_extra: dict) -> dict:
    body = {"model": MODEL, "messages": _messages(), "max_tokens": 1, **body_extra}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_fps_over_the_ceiling_is_refused_naming_field_and_flag(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _prompt_tokens(server, {"fps": MAX_FPS + 0.5})
    assert info.value.param == "mm_processor_kwargs.fps"
    assert f"limit of {MAX_FPS} (--max-video-fps)" in str(info.value.body)
    error = _refusal(server, {"media_io_kwargs": {"video": {"fps": 30}}})
    assert error["param"] == "media_io_kwargs.video.fps" and "--max-video-fps" in error["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"mm_processor_kwargs": {"fps": -1}}, "mm_processor_kwargs.fps"),
        ({"mm_processor_kwargs": {"fps": 0}}, "mm_processor_kwargs.fps"),
        ({"mm_processor_kwargs": {"fps": "4"}}, "mm_processor_kwargs.fps"),
        ({"mm_processor_kwargs": {"fps": True}}, "mm_processor_kwargs.fps"),
        ({"mm_processor_kwargs": {"fps": 1e308}}, "mm_processor_kwargs.fps"),
        ({"mm_processor_kwargs": {"num_frames": 2.5}}, "mm_processor_kwargs.num_frames"),
        ({"mm_processor_kwargs": {"max_frames": 10**30}}, "mm_processor_kwargs.max_frames"),
        ({"mm_processor_kwargs": {"size": {"longest_edge": "big"}}},
         "mm_processor_kwargs.size.longest_edge"),
        ({"media_io_kwargs": {"video": {"fps": -2}}}, "media_io_kwargs.video.fps"),
        ({"media_io_kwargs": {"video": {"num_frames": -1}}}, "media_io_kwargs.video.num_frames"),
        ({"media_io_kwargs": {"video": {"max_duration": 10}}},
         "media_io_kwargs.video.max_duration"),
        ({"media_io_kwargs": {"video": {"fps": 2, "num_frames": 8}}},
         "media_io_kwargs.video.num_frames"),
    ],
)  # fmt: skip
def test_bad_values_are_a_400_naming_the_field(server: Server, extra: dict, param: str) -> None:
    error = _refusal(server, extra)
    assert error["param"] == param, error
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_nan_is_refused_where_it_stands(server: Server) -> None:
    body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": _messages()})
    body = body[:-1] + ', "media_io_kwargs": {"video": {"fps": NaN}}}'
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "media_io_kwargs.video.fps"
