"""Workload construction: repeatable from the seed, exact repeats, JSONL datasets."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmserve.bench.client import arrival_offsets_s
from mmserve.bench.workload import (
    WorkloadConfig,
    WorkloadError,
    build_workload,
    parse_image_sizes,
)


def image_urls(req) -> list[str]:
    return [p["image_url"]["url"] for p in req.messages[-1]["content"] if p["type"] == "image_url"]


def test_same_seed_same_workload_and_other_seed_differs() -> None:
    cfg = WorkloadConfig(num_prompts=6, seed=3, image_sizes=((64, 48),), repeat_ratio=0.5)
    assert build_workload(cfg) == build_workload(cfg)
    other = build_workload(WorkloadConfig(**{**cfg.__dict__, "seed": 4}))
    assert [image_urls(r) for r in other] != [image_urls(r) for r in build_workload(cfg)]


@pytest.mark.parametrize("ratio, expected_repeats", [(0.0, 0), (0.25, 5), (0.5, 10), (1.0, 19)])
def test_repeats_resend_earlier_bytes_exactly(ratio: float, expected_repeats: int) -> None:
    cfg = WorkloadConfig(
        num_prompts=20, image_sizes=((32, 32), (40, 24)), images_per_request=2, repeat_ratio=ratio
    )
    requests = build_workload(cfg)
    seen: set[str] = set()
    for req in requests:
        urls = image_urls(req)
        assert len(urls) == 2
        is_repeat = all(u in seen for u in urls)
        assert is_repeat == (req.num_repeated_images == 2)
        assert is_repeat or not any(u in seen for u in urls)  # fresh images are all new
        seen.update(urls)
    assert sum(r.num_repeated_images > 0 for r in requests) == expected_repeats
    assert requests[0].num_repeated_images == 0  # nothing to repeat yet
    # Every request's text differs, so a prefix cache cannot swallow a repeated image.
    assert len({r.messages[-1]["content"][0]["text"] for r in requests}) == 20


def test_unique_images_each_sent_equally_often_shuffled() -> None:
    """The issue's workload: each of 8 pictures sent 6 times, in a shuffled order."""
    cfg = WorkloadConfig(num_prompts=48, seed=5, image_sizes=((32, 32),), unique_images=8)
    requests = build_workload(cfg)
    urls = [image_urls(r)[0] for r in requests]
    assert sorted(Counter(urls).values()) == [6] * 8
    first_seen = [urls.index(u) for u in urls]
    assert [r.num_repeated_images for r in requests] == [
        int(first < i) for i, first in enumerate(first_seen)
    ]
    ids = [sorted(set(first_seen)).index(f) for f in first_seen]
    assert ids != [i % 8 for i in range(48)]  # shuffled, not round-robin
    assert len({r.messages[-1]["content"][0]["text"] for r in requests}) == 48
    uneven = WorkloadConfig(num_prompts=10, image_sizes=((32, 32),), unique_images=4)
    counts = Counter(image_urls(r)[0] for r in build_workload(uneven))
    assert sorted(counts.values()) == [2, 2, 3, 3]
    with pytest.raises(WorkloadError, match="--unique-images and --repeat-ratio"):
        WorkloadConfig(num_prompts=8, unique_images=2, repeat_ratio=0.5)
    with pytest.raises(WorkloadError, match=r"--unique-images must be in \[1, --num-prompts\]"):
        WorkloadConfig(num_prompts=8, unique_images=9)


def test_images_are_smooth_jpegs_of_the_requested_sizes() -> None:
    cfg = WorkloadConfig(num_prompts=8, image_sizes=((448, 448), (320, 200)), input_len=0)
    sizes = set()
    for req in build_workload(cfg):
        (url,) = image_urls(req)
        assert url.startswith("data:image/jpeg;base64,")
        data = base64.b64decode(url.split(",", 1)[1])
        img = Image.open(io.BytesIO(data))
        sizes.add(img.size)
        # A smooth pattern compresses like a photo: far under 1 byte per pixel.
        assert len(data) < img.size[0] * img.size[1] / 4
        assert np.asarray(img).std() > 10  # not a flat colour
    assert sizes <= {(448, 448), (320, 200)}


def test_shared_prefix_is_one_system_prompt() -> None:
    requests = build_workload(WorkloadConfig(num_prompts=4, shared_prefix_tokens=50))
    systems = {r.messages[0]["content"] for r in requests}
    assert len(systems) == 1 and len(systems.pop().split()) == 50
    assert all(r.messages[0]["role"] == "system" for r in requests)


def test_dataset_is_cycled_with_per_line_max_tokens(tmp_path: Path) -> None:
    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    lines = [
        {"messages": [{"role": "user", "content": [img, {"type": "text", "text": "hi"}]}],
         "max_tokens": 7},
        [{"role": "user", "content": "plain text"}],
    ]  # fmt: skip
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    requests = build_workload(WorkloadConfig(num_prompts=5, output_len=9, dataset_path=str(path)))
    assert [r.max_tokens for r in requests] == [7, 9, 7, 9, 7]
    assert [r.num_images for r in requests] == [1, 0, 1, 0, 1]
    assert [r.num_repeated_images for r in requests] == [0, 0, 1, 0, 1]


def test_bad_inputs_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="WIDTHxHEIGHT"):
        parse_image_sizes("448")
    with pytest.raises(WorkloadError, match="repeat-ratio"):
        WorkloadConfig(num_prompts=1, repeat_ratio=1.5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n')
    with pytest.raises(WorkloadError, match="bad.jsonl:2"):
        build_workload(WorkloadConfig(num_prompts=1, dataset_path=str(bad)))
    cmd = [sys.executable, "-m", "mmserve.bench", "serve", "--image-sizes", "448by448"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "WIDTHxHEIGHT" in proc.stderr


def test_poisson_arrivals_are_repeatable_and_have_the_requested_rate() -> None:
    offsets = arrival_offsets_s(2000, 50.0, seed=1)
    assert np.array_equal(offsets, arrival_offsets_s(2000, 50.0, seed=1))
    assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0)
    assert 1999 / offsets[-1] == pytest.approx(50.0, rel=0.1)
    assert not np.any(arrival_offsets_s(5, float("inf"), seed=1))
