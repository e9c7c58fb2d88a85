"""Random and extreme values in every sampling field never stop the engine or touch a batchmate.

Each round puts hostile requests in one batch with an innocent greedy one. A hostile request
may be refused when it is built or added (a typed error) or fail on its own (finish_reason
"error"); the innocent one must get the same tokens as alone, and nothing may be left held.
"""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import MMServeError
from tests.support.factory import write_tiny_checkpoint
from tests.support.faults import assert_nothing_held, bypassing_validation, run_all
from tests.support.parity_cases import DIVERSE

NUM_ROUNDS = 40
HOSTILE_PER_ROUND = 4
MAX_MODEL_LEN = 48  # bounds every request, whatever max_tokens says

# Values of the types the HTTP edge lets through for each field (pydantic checks types, not
# ranges), extremes first.
FLOATS = [math.nan, math.inf, -math.inf, 1e-300, 5e-324, -0.0, 0.0, 1e308, -1.0, 0.5, 2.0]
INTS = [2**64, 2**64 - 1, -(2**63) - 1, -(2**63), 10**30, -1, 0, 1, 3, 10**6]
STRINGS = ["", "\ud800", "\x00", "a" * 500, "the", " ", "\ufffd", "</s>", "<|im_end|>"]
TYPED = {
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": INTS,
    "seed": [None, *INTS],
    "max_tokens": [None, *INTS],
    "min_tokens": INTS,
    "stop": [(), *[(s,) for s in STRINGS], tuple(STRINGS)],
    "stop_token_ids": [(), (0,), (2**64,), (-1,), tuple(range(50))],
    "ignore_eos": [True, False],
    "include_stop_str_in_output": [True, False],
    "skip_special_tokens": [True, False],
}
# Anything at all, for the fields the sampler and the generator re-check themselves.
ANYTHING = [None, True, "1", [], {}, 1.5, *FLOATS, *INTS]
UNTYPED_FIELDS = ("temperature", "top_p", "top_k", "seed")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    out = tmp_path_factory.mktemp("fuzz")
    checkpoint = write_tiny_checkpoint(out, "qwen2_vl", seed=3, **DIVERSE)
    return LLM(model=str(checkpoint), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=128)


def _hostile(rng: random.Random) -> SamplingParams | None:
    """Random typed values, then maybe a value of any type past validation; None when
    SamplingParams itself refuses (what the edge answers with a 400)."""
    fields = {name: rng.choice(values) for name, values in TYPED.items() if rng.random() < 0.25}
    try:
        params = SamplingParams(**fields)
    except MMServeError:
        return None
    if rng.random() < 0.5:
        name = rng.choice(UNTYPED_FIELDS)
        params = bypassing_validation(params, **{name: rng.choice(ANYTHING)})
    return params


def test_no_sampling_value_stops_the_engine_or_touches_a_batchmate(llm: LLM) -> None:
    engine = llm.engine
    innocent_prompt = engine.input_processor.process_generate_input("hello world")
    innocent = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("innocent", innocent_prompt, innocent)
    expected = run_all(engine)["innocent"].outputs[0].token_ids
    rng = random.Random(20)
    prompts = [engine.input_processor.process_generate_input(t) for t in ("a", "the fox", "?")]
    outcomes = {"refused": 0, "failed": 0, "answered": 0}
    for round_idx in range(NUM_ROUNDS):
        engine.add_request("innocent", innocent_prompt, msgspec.structs.replace(innocent))
        added = []
        for i in range(HOSTILE_PER_ROUND):
            params = _hostile(rng)
            request_id = f"hostile-{round_idx}-{i}"
            try:
                if params is None:
                    raise MMServeError("refused by SamplingParams")
                engine.add_request(request_id, rng.choice(prompts), params)
                added.append(request_id)
            except MMServeError:
                outcomes["refused"] += 1
        finals = run_all(engine)
        assert finals["innocent"].outputs[0].token_ids == expected, (round_idx, finals)
        for request_id in added:
            failed = finals[request_id].outputs[0].finish_reason == "error"
            outcomes["failed" if failed else "answered"] += 1
        assert_nothing_held(engine)
        assert engine.dead_reason is None
    # the fuzz really reached all three outcomes
    assert all(n > 5 for n in outcomes.values()), outcomes
