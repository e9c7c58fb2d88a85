"""--generation-config: the checkpoint's recommended sampling values as request defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmserve.generation_config import load_sampling_defaults

QWEN2_VL_7B_INSTRUCT = {  # the published file's sampling keys
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "repetition_penalty": 1.05,
    "temperature": 0.01,
    "top_k": 1,
    "top_p": 0.001,
}


def write(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_auto_reads_the_models_sampling_keys_only(tmp_path: Path) -> None:
    model = write(tmp_path / "m", {**QWEN2_VL_7B_INSTRUCT, "max_new_tokens": 2048})
    assert load_sampling_defaults("auto", model) == {
        "repetition_penalty": 1.05,
        "temperature": 0.01,
        "top_k": 1,
        "top_p": 0.001,
        "max_tokens": 2048,
    }


def test_engine_defaults_and_missing_files(tmp_path: Path) -> None:
    model = write(tmp_path / "m", QWEN2_VL_7B_INSTRUCT)
    assert load_sampling_defaults("vllm", model) == {}
    assert load_sampling_defaults("mmserve", model) == {}
    assert load_sampling_defaults("auto", tmp_path / "no-file-here") == {}  # auto: optional
    with pytest.raises(ValueError, match="no generation_config.json there"):
        load_sampling_defaults(str(tmp_path / "elsewhere"), model)  # a named one must exist


def test_another_directory_may_supply_them(tmp_path: Path) -> None:
    model = write(tmp_path / "m", QWEN2_VL_7B_INSTRUCT)
    other = write(tmp_path / "other", {"temperature": 0.7, "top_p": 0.8})
    assert load_sampling_defaults(str(other), model) == {"temperature": 0.7, "top_p": 0.8}


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": 2.5},
        {"repetition_penalty": 0},
        {"max_new_tokens": 0},
        {"temperature": True},
        {"temperature": "0.7"},
    ],
)
def test_a_bad_value_stops_start_up_naming_the_key(tmp_path: Path, bad: dict) -> None:
    model = write(tmp_path / "m", bad)
    key = next(iter(bad))
    with pytest.raises(ValueError, match=f"has {key}="):
        load_sampling_defaults("auto", model)


def test_unreadable_file_and_unsupported_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_sampling_defaults("auto", broken)
    model = write(tmp_path / "m", {"min_p": 0.1, "temperature": 0.5, "typical_p": 0.9})
    # min_p is applied (as in vLLM); a key vLLM ignores is ignored here too
    assert load_sampling_defaults("auto", model) == {"temperature": 0.5, "min_p": 0.1}


def test_the_offline_api_starts_from_the_checkpoints_values(tmp_path: Path) -> None:
    import shutil

    from mmserve import LLM, SamplingParams
    from mmserve.config.model import bundled_toy_model_dir

    model = Path(shutil.copytree(bundled_toy_model_dir(), tmp_path / "toy"))
    config = json.loads((model / "generation_config.json").read_text())
    write(model, {**config, "temperature": 0.0, "max_new_tokens": 2, "repetition_penalty": 1.3})
    with LLM(model=str(model)) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 2)
        assert defaults.repetition_penalty == 1.3
        # A bare question with no chat template: the toy rambles on rather than stopping, so
        # the checkpoint's max_new_tokens is what ends it.
        prompt = "What is in the image?"
        text = llm.generate([prompt])[0].outputs[0]
        explicit = SamplingParams(temperature=0, max_tokens=2, repetition_penalty=1.3)
        assert text.token_ids == llm.generate([prompt], explicit)[0].outputs[0].token_ids
        assert len(text.token_ids) == 2 and text.finish_reason == "length"
    with LLM(model=str(model), generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_request_fields_win_over_the_defaults() -> None:
    from mmserve.api.protocol import CompletionRequest

    defaults = {"temperature": 0.01, "top_p": 0.001, "top_k": 1, "repetition_penalty": 1.05}
    left_out = CompletionRequest(prompt="x").to_sampling_params(None, defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.01, 0.001, 1)
    assert left_out.repetition_penalty == 1.05
    given = CompletionRequest(prompt="x", temperature=0.7, top_k=0, repetition_penalty=1.0)
    params = given.to_sampling_params(None, defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.7, 0, 1.0)
    assert params.top_p == 0.001  # the one field it left out
