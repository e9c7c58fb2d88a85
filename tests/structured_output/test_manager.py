"""StructuredOutputManager on its own: which rows it masks, what it feeds, what fails."""

from __future__ import annotations

import numpy as np

from mmserve.errors import FailureKind
from mmserve.scheduling.outputs import ModelRunnerOutput
from mmserve.structured_output.manager import StructuredOutputManager
from mmserve.structured_output.params import StructuredOutputParams
from tests.support.grammar import toy_compiler


def manager_with(**grammars: StructuredOutputParams) -> StructuredOutputManager:
    manager = StructuredOutputManager(toy_compiler)
    for request_id, params in grammars.items():
        manager.register(request_id, manager.make_matcher(params))
    return manager


def allowed(words: np.ndarray) -> list[int]:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return np.nonzero(bits)[0].tolist()


def test_only_rows_with_a_grammar_are_masked():
    manager = manager_with(a=StructuredOutputParams.choice(["yes", "no"]))
    result = manager.bitmask(["free", "a"])
    assert result.failures == {}
    assert result.grammar_output.request_ids == ("a",)
    # [1, ceil(576 / 32)]: the model's logits width, not the tokenizer's 526 tokens
    assert result.grammar_output.bitmask.shape == (1, 18)
    tok = manager.compiler.tokenizer
    first = {tok.tokenize_str("yes")[0], tok.tokenize_str("no")[0]}
    assert first <= set(allowed(result.grammar_output.bitmask[0]))
    assert all(t < 526 for t in allowed(result.grammar_output.bitmask[0]))
    assert manager.bitmask(["free"]).grammar_output is None


def test_accept_completes_a_finished_grammar_and_fails_a_refused_token():
    manager = manager_with(
        a=StructuredOutputParams.choice(["yes"]), b=StructuredOutputParams.regex("[0-9]+")
    )
    tok = manager.compiler.tokenizer
    result = manager.accept({"a": tok.tokenize_str("yes"), "b": tok.tokenize_str("x")})
    assert result.completed == {"a"}
    assert set(result.failures) == {"b"}
    failure = result.failures["b"]
    assert failure.kind is FailureKind.REQUEST and failure.param == "structured_outputs"
    assert "structured output failed" in failure.message
    # a failed matcher fails its request again rather than masking (its row samples freely)
    mask = manager.bitmask(["b"])
    assert set(mask.failures) == {"b"}
    assert (mask.grammar_output.bitmask == -1).all()


def test_accept_step_moves_failures_into_the_runner_output():
    manager = manager_with(
        a=StructuredOutputParams.choice(["yes"]), b=StructuredOutputParams.regex("[0-9]+")
    )
    tok = manager.compiler.tokenizer
    runner_output = ModelRunnerOutput(
        {"a": tok.tokenize_str("yes"), "b": tok.tokenize_str("x"), "free": [7]}
    )
    out, completed = manager.accept_step(runner_output, {})
    assert completed == {"a"}
    assert set(out.errors) == {"b"}
    assert out.sampled_token_ids == {"a": tok.tokenize_str("yes"), "free": [7]}


def test_free_and_retain_leave_no_matcher_behind():
    manager = manager_with(
        a=StructuredOutputParams.json_object(), b=StructuredOutputParams.json_object()
    )
    assert manager.num_matchers == 2
    manager.free(["a", "unknown"])
    assert manager.num_matchers == 1
    manager.retain({"c"})
    assert manager.num_matchers == 0


def test_the_compiler_is_built_on_first_use_only():
    calls = []

    def make():
        calls.append(1)
        return toy_compiler()

    manager = StructuredOutputManager(make)
    assert manager.bitmask(["x"]).grammar_output is None
    assert calls == []
    manager.make_matcher(StructuredOutputParams.json_object())
    manager.make_matcher(StructuredOutputParams.regex("a"))
    assert calls == [1]
