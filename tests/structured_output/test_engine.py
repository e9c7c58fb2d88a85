"""Structured output through the real engine (the bundled toy model and a tiny random one):
the answers match their grammar, other requests are untouched, nothing leaks."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidRequestError
from mmserve.structured_output.params import StructuredOutputParams
from tests.support.factory import write_tiny_checkpoint
from tests.support.grammar import SCHEMA
from tests.support.toy_examples import held_out

GREEDY = dict(temperature=0, max_tokens=48)


def _structured(so: StructuredOutputParams, **kwargs) -> SamplingParams:
    return SamplingParams(**{**GREEDY, **kwargs}, structured_outputs=so)


@pytest.fixture(scope="module")
def toy() -> LLM:
    return LLM(max_model_len=1024)


@pytest.fixture(scope="module")
def random_llm(tmp_path_factory) -> LLM:
    out = tmp_path_factory.mktemp("structured_random")
    return LLM(model=str(write_tiny_checkpoint(out, "qwen2_vl", seed=5)), max_model_len=1024)


def _questions(num: int) -> list[list[dict]]:
    return [q.messages() for q in held_out("shape", num)]


@pytest.mark.parametrize("which", ["toy", "random_llm"])
def test_json_schema_output_validates_on_20_prompts(which, request):
    llm = request.getfixturevalue(which)
    outs = llm.chat(_questions(20), _structured(StructuredOutputParams.json(SCHEMA)))
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        # the grammar was complete: the request ended without the model choosing EOS
        assert completion.token_ids[-1] not in llm.engine.core.eos_token_ids
    assert llm.engine.core.structured_output.num_matchers == 0


def test_regex_and_choice(toy):
    prompts = _questions(6)
    regex = StructuredOutputParams.regex(r"(red|blue) [0-9]{2}")
    for out in toy.chat(prompts, _structured(regex)):
        assert re.fullmatch(r"(red|blue) [0-9]{2}", out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    choices = ["circle", "square", "no idea"]
    for out in toy.chat(prompts, _structured(StructuredOutputParams.choice(choices))):
        assert out.outputs[0].text in choices
        assert out.outputs[0].finish_reason == "stop"


def test_lark_grammar(toy):
    grammar = 'start: "answer: " WORD\nWORD: /[a-z]{1,6}/'
    for out in toy.chat(_questions(3), _structured(StructuredOutputParams.grammar(grammar))):
        assert re.fullmatch(r"answer: [a-z]{1,6}", out.outputs[0].text), out.outputs[0].text


def test_json_object_is_an_object_or_cut_at_max_tokens(toy):
    outs = toy.chat(_questions(4), _structured(StructuredOutputParams.json_object()))
    for out in outs:
        completion = out.outputs[0]
        assert completion.text.startswith("{")
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # as in vLLM: cut at max_tokens, and then not valid JSON
            assert completion.finish_reason == "length"
            assert len(completion.token_ids) == GREEDY["max_tokens"]


def test_structured_and_free_requests_in_one_batch_do_not_affect_each_other(toy):
    prompts = _questions(4)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    structured = _structured(StructuredOutputParams.json(SCHEMA))
    alone_free = [o.outputs[0].token_ids for o in toy.chat(prompts, free)]
    alone_structured = [o.outputs[0].token_ids for o in toy.chat(prompts, structured)]
    mixed = toy.chat(prompts + prompts, [free] * 4 + [structured] * 4)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone_free
    assert [o.outputs[0].token_ids for o in mixed[4:]] == alone_structured
    # the grammar really changed the structured answers
    assert alone_free != alone_structured


def test_multiprocess_gives_the_same_greedy_outputs(toy):
    prompts = _questions(4)
    params = [
        _structured(StructuredOutputParams.json(SCHEMA)),
        _structured(StructuredOutputParams.regex(r"[a-z]{3}-[0-9]")),
        _structured(StructuredOutputParams.choice(["yes", "no"])),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    expected = [o.outputs[0].token_ids for o in toy.chat(prompts, params)]
    with LLM(max_model_len=1024, multiprocess=True) as remote:
        got = [o.outputs[0].token_ids for o in remote.chat(prompts, params)]
        with pytest.raises(InvalidRequestError, match="invalid regex") as info:
            remote.generate("hi", _structured(StructuredOutputParams.regex("a(")))
        assert info.value.param == "structured_outputs"
        # the refused request left nothing behind; the engine goes on
        assert remote.generate("hi", params[2])[0].outputs[0].text in ("yes", "no")
    assert got == expected


def test_a_bad_spec_is_refused_before_it_is_queued(toy):
    with pytest.raises(InvalidRequestError, match="invalid JSON schema") as info:
        toy.generate("hi", _structured(StructuredOutputParams.json({"type": "bogus"})))
    assert info.value.param == "structured_outputs"
    assert not toy.engine.has_unfinished_requests()
    assert toy.engine.core.structured_output.num_matchers == 0


def test_matchers_are_freed_on_abort_and_on_failure(toy):
    engine = toy.engine
    core = engine.core
    prompt = engine.input_processor.process_chat(_questions(1)[0])
    params = _structured(StructuredOutputParams.json_object(), max_tokens=40)
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)
    engine.step()
    assert core.structured_output.num_matchers == 2
    engine.abort_requests(["a"])
    assert core.structured_output.num_matchers == 1
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert core.structured_output.num_matchers == 0


def test_preemption_keeps_the_matcher_in_step_with_the_tokens(tmp_path):
    prompts = _questions(6)
    params = _structured(StructuredOutputParams.json(SCHEMA))
    roomy = LLM(block_size=4, max_model_len=1024)
    expected = [o.outputs[0].token_ids for o in roomy.chat(prompts, params)]
    # enough 4-token blocks for the longest request alone, about half of what all six need
    lengths = [len(roomy.engine.input_processor.process_chat(m).prompt_token_ids) for m in prompts]
    num_blocks = max((max(lengths) + 40) // 4 + 2, sum((n + 30) // 4 for n in lengths) // 2)
    roomy.shutdown()
    tight = LLM(block_size=4, max_model_len=1024, num_gpu_blocks_override=num_blocks)
    engine = tight.engine
    for i, messages in enumerate(prompts):
        engine.add_request(str(i), engine.input_processor.process_chat(messages), params)
    finals, num_preempted = {}, 0
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        num_preempted = max(
            [num_preempted, *(r.num_preemptions for r in engine.core.scheduler.requests.values())]
        )
    assert num_preempted > 0, "the test did not preempt anything"
    got = [finals[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    assert got == expected
    for out in finals.values():
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert engine.core.structured_output.num_matchers == 0
