"""What only the engine can check: --max-logprobs, logit_bias ids, reserved request ids."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config.model import CheckpointConfig
from mmserve.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    with LLM(max_logprobs=3) as llm:  # the bundled toy model
        yield llm


def test_logprobs_over_max_logprobs_are_refused_naming_the_flag(llm) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("hi", SamplingParams(logprobs=4))
    assert info.value.param == "logprobs" and "--max-logprobs" in info.value.message
    out = llm.generate("hi", SamplingParams(logprobs=3, max_tokens=2, temperature=0))[0]
    assert all(len(entry) in (3, 4) for entry in out.outputs[0].logprobs)


def test_a_logit_bias_outside_the_vocabulary_is_refused(llm) -> None:
    vocab_size = llm.get_tokenizer().vocab_size
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("hi", SamplingParams(logit_bias={vocab_size: 1.0}))
    assert info.value.param == "logit_bias"
    assert not llm.engine.has_unfinished_requests()


def test_request_ids_may_not_take_the_child_separator(llm) -> None:
    prompt = llm.engine.input_processor.process_generate_input("hi")
    with pytest.raises(ValueError, match="reserved"):
        llm.engine.add_request("a#1", prompt, SamplingParams())


def test_max_logprobs_must_be_a_count() -> None:
    with pytest.raises(ValueError, match="--max-logprobs"):
        CheckpointConfig(max_logprobs=-1)
