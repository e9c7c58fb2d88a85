"""Model ids as vLLM takes them: a directory, or a Hugging Face hub id found in the hub cache.

Nothing downloads here: each test builds a hub cache layout (models--org--name/refs,
snapshots/<commit>) around the bundled toy checkpoint and resolves with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config.engine import EngineConfig
from mmserve.config.model import bundled_toy_model_dir
from mmserve.engine.model_source import (
    ModelNotFoundError,
    hub_cache_dir,
    resolve_model_dir,
    with_local_sources,
)
from tests.support.hub_cache import COMMIT, OTHER_COMMIT, make_hub_cache


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return make_hub_cache(tmp_path, "acme/toy-vl", {"main": COMMIT, "v2": OTHER_COMMIT})


def test_a_hub_id_resolves_to_its_snapshot_offline(offline_hub: Path) -> None:
    assert resolve_model_dir("acme/toy-vl") == offline_hub / "snapshots" / COMMIT
    assert resolve_model_dir("acme/toy-vl", revision="v2") == offline_hub / "snapshots" / (
        OTHER_COMMIT
    )
    assert resolve_model_dir("acme/toy-vl", revision=COMMIT) == offline_hub / "snapshots" / COMMIT


def test_hf_home_and_hf_hub_cache_are_read_when_resolving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"
    assert hub_cache_dir(str(tmp_path / "dl")) == tmp_path / "dl"  # --download-dir wins


def test_download_dir_is_where_the_id_is_looked_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    repo = make_hub_cache(tmp_path / "elsewhere", "acme/toy-vl", {"main": COMMIT})
    found = resolve_model_dir("acme/toy-vl", download_dir=str(tmp_path / "elsewhere" / "hub"))
    assert found == repo / "snapshots" / COMMIT


@pytest.mark.parametrize(
    ("model", "revision", "expected"),
    [
        ("acme/missing", None, r"acme/missing: no such directory, and not found in the local hub"),
        ("acme/toy-vl", "v3", r"acme/toy-vl@v3: no such directory, and not found"),
        ("./no/such/dir", None, r"no such directory, and not a Hugging Face hub id"),
        ("a b", None, r"not a Hugging Face hub id"),
    ],
)
def test_an_unresolvable_model_names_both_attempts(
    offline_hub: Path, model: str, revision: str | None, expected: str
) -> None:
    with pytest.raises(ModelNotFoundError, match=expected) as exc:
        resolve_model_dir(model, revision=revision)
    if "hub cache" in str(exc.value):
        assert "unset HF_HUB_OFFLINE" in str(exc.value)


def test_a_revision_with_a_local_directory_is_refused_not_dropped(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="--revision v1 cannot apply"):
        resolve_model_dir(str(tmp_path), revision="v1")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a directory"):
        resolve_model_dir(str(tmp_path / "file"))


def test_a_snapshot_without_config_is_not_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = make_hub_cache(tmp_path, "acme/broken", {"main": COMMIT})
    (repo / "snapshots" / COMMIT / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model_dir("acme/broken")


def test_with_local_sources_keeps_the_name_as_given(offline_hub: Path) -> None:
    config = with_local_sources(
        EngineConfig.from_kwargs(model="acme/toy-vl", revision="v2", tokenizer="acme/toy-vl")
    )
    args = config.checkpoint
    assert args.model == str(offline_hub / "snapshots" / OTHER_COMMIT)
    assert args.tokenizer == str(offline_hub / "snapshots" / COMMIT)  # its own revision: main
    assert args.served_model_names == ("acme/toy-vl",)  # what clients send, as with vLLM
    assert args.revision is None and with_local_sources(config) == config  # idempotent
    local = EngineConfig.from_kwargs(model=bundled_toy_model_dir())
    assert with_local_sources(local) is local


def test_the_offline_api_serves_a_hub_id(offline_hub: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with LLM(model="acme/toy-vl") as from_hub:
        assert from_hub.engine_config.checkpoint.model == "acme/toy-vl"
        hub_text = from_hub.generate(["a red"], greedy)[0].outputs[0].text
    with LLM() as local:
        assert local.generate(["a red"], greedy)[0].outputs[0].text == hub_text
