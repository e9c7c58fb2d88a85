"""One request's bad state fails that request alone: the engine and its batchmates go on."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.engine.frontend.output_processor import OutputProcessor
from mmserve.errors import EngineDeadError, FailureKind, InvalidRequestError
from mmserve.execution.encoder.runner import EncoderRunner
from mmserve.multimodal import ProcessedPrompt
from tests.support.factory import random_image, write_tiny_checkpoint
from tests.support.faults import (
    FaultyExecutor,
    assert_nothing_held,
    bypassing_validation,
    rewired,
    run_all,
)
from tests.support.parity_cases import DIVERSE

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("isolation")
    return write_tiny_checkpoint(out, "qwen2_vl", seed=3, **DIVERSE)


@pytest.fixture
def llm(checkpoint: Path) -> LLM:
    return LLM(model=str(checkpoint), num_gpu_blocks_override=256)


def _prompt(llm: LLM, text: str, image_seed: int | None = None) -> ProcessedPrompt:
    if image_seed is None:
        return llm.engine.input_processor.process_generate_input(text)
    image = random_image(56, 84, seed=image_seed)
    request = {"prompt": f"{IMG}{text}", "multi_modal_data": {"image": image}}
    return llm.engine.input_processor.process_generate_input(request)


def _tokens(finals, request_id: str) -> list[int]:
    out = finals[request_id].outputs[0]
    assert out.finish_reason == "length", (request_id, finals[request_id].error)
    return out.token_ids


def _batchmates(llm: LLM) -> dict[str, tuple[ProcessedPrompt, SamplingParams]]:
    return {
        "greedy": (_prompt(llm, "hello world", image_seed=1), GREEDY),
        "seeded": (_prompt(llm, "the quick brown fox", image_seed=2), SEEDED),
    }


def _run_with(llm_engine, mates, extra: dict | None = None):
    for request_id, (prompt, params) in {**mates, **(extra or {})}.items():
        llm_engine.add_request(request_id, prompt, params)
    return run_all(llm_engine)


@pytest.mark.parametrize(
    "seed", [2**64, -(2**63) - 1, 10**5000, 1.5], ids=["2^64", "-2^63-1", "5000 digits", "float"]
)
def test_a_seed_torch_cannot_take_is_refused_and_leaves_nothing(llm: LLM, seed) -> None:
    engine = llm.engine
    params = bypassing_validation(SEEDED, seed=seed)
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("bad", _prompt(llm, "hello"), params)
    assert refused.value.param == "seed"
    assert len(str(refused.value)) < 200  # a 5000-digit seed is not echoed back
    assert_nothing_held(engine)
    for edge in (2**64 - 1, -(2**63)):  # the extremes torch accepts still run
        engine.add_request(
            f"edge{edge}", _prompt(llm, "hello"), bypassing_validation(SEEDED, seed=edge)
        )
    finals = run_all(engine)
    assert all(len(_tokens(finals, rid)) == 6 for rid in finals) and len(finals) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", -1.0),
        ("top_p", float("nan")),
        ("top_k", 2.5),
        ("min_tokens", "3"),
    ],
)
def test_a_bad_sampling_value_fails_only_its_row(llm: LLM, field: str, value) -> None:
    engine = llm.engine
    mates = _batchmates(llm)
    alone = _run_with(engine, mates)
    bad = bypassing_validation(SEEDED, **{field: value})
    crowd = _run_with(engine, mates, {"bad": (_prompt(llm, "what is this?", image_seed=3), bad)})
    assert crowd["bad"].outputs[0].finish_reason == "error"
    assert crowd["bad"].error_kind is FailureKind.REQUEST
    assert crowd["bad"].error_param == field
    for request_id in mates:
        assert _tokens(crowd, request_id) == _tokens(alone, request_id)
    assert_nothing_held(engine)


def test_a_tiny_temperature_samples_the_best_token(llm: LLM) -> None:
    engine = llm.engine
    prompt = _prompt(llm, "hello world", image_seed=1)
    engine.add_request("greedy", prompt, GREEDY)
    for i, temperature in enumerate((1e-300, 5e-324, 1e-45)):
        params = bypassing_validation(SEEDED, temperature=temperature)
        engine.add_request(f"tiny{i}", prompt, params)
    finals = run_all(engine)
    for i in range(3):
        assert _tokens(finals, f"tiny{i}") == _tokens(finals, "greedy")


def test_a_detokenizer_that_raises_fails_only_its_request(
    llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = llm.get_tokenizer()

    def decode(ids, skip_special_tokens: bool) -> str:
        if not skip_special_tokens:  # only the request that asked for special tokens
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    mates = _batchmates(llm)
    alone = _run_with(llm.engine, mates)
    engine = rewired(llm.engine, output_processor=OutputProcessor(decode, llm.engine.metrics))
    bad = (_prompt(llm, "what is this?"), bypassing_validation(GREEDY, skip_special_tokens=False))
    with caplog.at_level(logging.ERROR):
        crowd = _run_with(engine, mates, {"bad": bad})
    assert crowd["bad"].outputs[0].finish_reason == "error"
    assert crowd["bad"].error_kind is FailureKind.INTERNAL
    for request_id in mates:
        assert crowd[request_id].outputs[0].text == alone[request_id].outputs[0].text
    logged = [r for r in caplog.records if r.exc_info and "bad" in r.getMessage()]
    assert len(logged) == 1  # once, with the traceback
    assert_nothing_held(engine)


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(
    llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    mates = _batchmates(llm)
    alone = _run_with(llm.engine, mates)
    executor = FaultyExecutor(llm.engine.core.executor)
    engine = rewired(llm.engine, executor=executor)
    executor.crash_after(1)  # the second step: both requests are decoding
    with caplog.at_level(logging.ERROR):
        crashed = _run_with(engine, mates)
    assert executor.num_crashes == 1
    for request_id in mates:
        assert crashed[request_id].outputs[0].finish_reason == "error"
        assert crashed[request_id].error_kind is FailureKind.INTERNAL
    (logged,) = [r for r in caplog.records if r.exc_info]  # once, with the traceback
    assert all(rid in logged.getMessage() for rid in mates)
    assert_nothing_held(engine)
    # the runner's state survived the crash: the same requests give the same answers again
    again = _run_with(engine, mates)
    assert {rid: _tokens(again, rid) for rid in mates} == {
        rid: _tokens(alone, rid) for rid in mates
    }
    assert engine.dead_reason is None


def test_a_bug_outside_the_model_fails_the_unfinished_and_the_engine_goes_on(llm: LLM) -> None:
    class BrokenOnce(OutputProcessor):
        has_raised = False

        def process(self, updates):
            if not self.has_raised:
                self.has_raised = True
                raise KeyError("injected bookkeeping bug")
            return super().process(updates)

    tokenizer = llm.get_tokenizer()
    broken = BrokenOnce(
        lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip), llm.engine.metrics
    )
    engine = rewired(llm.engine, output_processor=broken)
    mates = _batchmates(llm)
    failed = _run_with(engine, mates)
    assert {rid: failed[rid].error_kind for rid in mates} == dict.fromkeys(
        mates, FailureKind.INTERNAL
    )
    assert_nothing_held(engine)
    again = _run_with(engine, mates)
    assert all(len(_tokens(again, rid)) == 6 for rid in mates)


def test_a_failed_step_on_a_dead_device_declares_the_engine_dead(llm: LLM) -> None:
    executor = FaultyExecutor(llm.engine.core.executor)
    engine = rewired(llm.engine, executor=executor)
    executor.crash_after(0)
    executor.is_device_dead = True
    engine.add_request("a", _prompt(llm, "hello"), GREEDY)
    with pytest.raises(EngineDeadError):
        engine.step()
    assert engine.dead_reason is not None
    with pytest.raises(EngineDeadError):
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request("b", _prompt(llm, "hello"), GREEDY)


def test_an_item_whose_encoding_failed_does_not_fail_later_requests(
    llm: LLM, checkpoint: Path
) -> None:
    prompt = _prompt(llm, "what is this?", image_seed=5)
    reference = _run_with(LLM(model=str(checkpoint)).engine, {"ref": (prompt, GREEDY)})
    runner = llm.engine.core.executor.runner
    embed = runner.model.embed_multimodal
    calls = []

    def fails_first(pixels, grids):
        calls.append(len(grids))
        if len(calls) <= 2:  # the batched call and the retry of the item alone
            raise RuntimeError("injected encoder failure")
        return embed(pixels, grids)

    runner.encoder = EncoderRunner(
        fails_first,
        runner.encoder_cache,
        max_patches_per_call=1 << 20,
    )
    # the failed item stays resident in the scheduler's books: the next request with the
    # same picture is not scheduled to encode it
    first = _run_with(llm.engine, {"first": (prompt, GREEDY)})
    assert first["first"].error_kind is FailureKind.INTERNAL
    later = _run_with(llm.engine, {"later": (prompt, GREEDY)})
    assert _tokens(later, "later") == _tokens(reference, "ref")
    assert len(calls) == 3
    assert_nothing_held(llm.engine)


def test_a_request_whose_model_output_is_nan_fails_alone_and_leaves_no_nan(llm: LLM) -> None:
    """NaN pixels make NaN embeddings, NaN KV and NaN logits for that request only; its KV
    blocks must not carry NaN to the requests that get them next.

    uint8 levels cannot be NaN: the tower's input is poisoned where the bad item's normalised
    values arrive (what a NaN pixel would have been)."""
    engine = llm.engine
    bad = _prompt(llm, "what is this?", image_seed=9)
    feature = bad.mm_features[0]
    bad_values = torch.from_numpy(bad.mm_data[feature.identifier].normalized())
    runner = engine.core.executor.runner
    embed = runner.model.embed_multimodal

    def nan_for_bad(values: torch.Tensor, grids):
        start = 0
        for t, h, w in grids:
            rows = slice(start, start + t * h * w)
            if values[rows].shape == bad_values.shape and torch.equal(values[rows], bad_values):
                values = values.clone()
                values[rows] = float("nan")
            start += t * h * w
        return embed(values, grids)

    runner.encoder = EncoderRunner(nan_for_bad, runner.encoder_cache, max_patches_per_call=1 << 20)
    params = msgspec.structs.replace(GREEDY, max_tokens=20)
    mates = {f"m{i}": (_prompt(llm, "hello " * (i + 1), image_seed=i), params) for i in range(3)}
    alone = _run_with(engine, mates)
    crowd = _run_with(engine, mates, {"bad": (bad, params)})
    assert crowd["bad"].error_kind is FailureKind.INTERNAL
    assert "NaN" in crowd["bad"].error
    after = _run_with(engine, mates)  # on blocks the bad request held
    for request_id in mates:
        assert _tokens(crowd, request_id) == _tokens(alone, request_id)
        assert _tokens(after, request_id) == _tokens(alone, request_id)
    assert_nothing_held(engine)
