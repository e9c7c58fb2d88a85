"""n > 1: one request, n sequences that share the prompt's KV blocks and its encoded image."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec
import pytest

from mmserve import LLM, SamplingParams
from mmserve.engine.frontend.llm_engine import LLMEngine
from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.executor import Executor
from mmserve.multimodal import ItemData
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tests.support.factory import random_image
from tests.support.faults import assert_nothing_held, rewired, run_all
from tests.support.parity_cases import CASES, _request, chat

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
SAMPLED = SamplingParams(n=3, temperature=1.5, seed=11, max_tokens=8, ignore_eos=True)


def _ids(out) -> list[list[int]]:
    assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
    return [c.token_ids for c in out.outputs]


@pytest.fixture(scope="module")
def llm(diverse_checkpoint_qwen2):
    with LLM(model=str(diverse_checkpoint_qwen2), max_num_batched_tokens=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def diverse_checkpoint_qwen2(tmp_path_factory):
    from tests.support.factory import write_tiny_checkpoint
    from tests.support.parity_cases import DIVERSE

    return write_tiny_checkpoint(tmp_path_factory.mktemp("n"), "qwen2_vl", seed=3, **DIVERSE)


def test_seeded_n_is_reproducible_differs_per_sample_and_equals_seed_plus_i(llm) -> None:
    prompt = _request(*CASES["one_image"])
    first = llm.generate(prompt, SAMPLED)[0]
    assert len(first.outputs) == 3 and first.finished
    assert _ids(llm.generate(prompt, SAMPLED)[0]) == _ids(first)
    assert len({tuple(t) for t in _ids(first)}) > 1, "the samples should differ"
    for i, tokens in enumerate(_ids(first)):
        alone = msgspec.structs.replace(SAMPLED, n=1, seed=SAMPLED.seed + i)
        assert _ids(llm.generate(prompt, alone)[0]) == [tokens]


def test_greedy_n_gives_n_identical_answers(llm) -> None:
    greedy = SamplingParams(n=4, temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate(_request(*CASES["text_only"]), greedy)[0]
    ids = _ids(out)
    assert len(ids) == 4 and all(t == ids[0] for t in ids)
    assert [c.num_tokens for c in out.outputs] == [6] * 4


def _peak_blocks(engine: LLMEngine, prompt, params: SamplingParams, request_id: str) -> int:
    """Most distinct KV blocks held at once while the request runs."""
    processed = engine.input_processor.process_generate_input(prompt)
    engine.add_request(request_id, processed, params)
    kv = engine.core.scheduler.kv_cache_manager
    peak = 0
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return peak
        engine.step()
        held = {b for rid in engine.core.scheduler.requests for b in kv.block_ids(rid)}
        peak = max(peak, len(held))
    raise AssertionError("the request did not finish")


def test_siblings_share_the_prompt_blocks_and_encode_the_image_once(diverse_checkpoint_qwen2):
    text = chat(f"{IMG}" + "Describe every detail of this picture, please. " * 12)
    image = random_image(112, 112, seed=5)
    prompt = {"prompt": text, "multi_modal_data": {"image": [image]}}
    params = msgspec.structs.replace(SAMPLED, max_tokens=4)
    peaks = {}
    for n in (1, 3):
        # a fresh engine each time, so that nothing is cached from the other run
        with LLM(model=str(diverse_checkpoint_qwen2), max_num_batched_tokens=512) as fresh:
            engine = fresh.engine
            p = msgspec.structs.replace(params, n=n)
            peaks[n] = _peak_blocks(engine, prompt, p, "req")
            stats = engine.core.scheduler.make_stats()
            encoded = engine.metrics.snapshot().counters["encoder_items_encoded"]
            assert encoded == 1, f"n={n}: the image was encoded {encoded} times"
            num_prompt = len(engine.input_processor.process_generate_input(prompt).prompt_token_ids)
            block_size = engine.core.scheduler.cache_config.block_size
            if n == 3:
                # both later siblings hit every full prompt block of the first
                assert stats.prefix_cache_hits >= 2 * (num_prompt // block_size) * block_size
            assert_nothing_held(engine)
    assert peaks[1] > 10  # a prompt long enough for the comparison to mean something
    assert peaks[3] <= peaks[1] + 4, peaks  # each sibling adds only its own tail blocks


def test_aborting_the_request_aborts_every_sample_and_frees_everything(llm) -> None:
    engine = llm.engine
    processed = engine.input_processor.process_generate_input(_request(*CASES["one_image"]))
    long = msgspec.structs.replace(SAMPLED, max_tokens=50)
    engine.add_request("gone", processed, long)
    for _ in range(3):
        engine.step()
    assert len(engine.core.scheduler.requests) == 3
    (final,) = engine.abort_requests(["gone"])
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort"] * 3
    assert_nothing_held(engine)


class FailOneExecutor:
    """A real executor whose answer for one request id turns into a failure."""

    def __init__(self, executor: Executor, request_id: str) -> None:
        self.executor = executor
        self.request_id = request_id

    def add_mm_data(self, request_id: str, data: Mapping[str, ItemData]) -> None:
        self.executor.add_mm_data(request_id, data)

    def free_mm_data(self, request_ids: Iterable[str]) -> None:
        self.executor.free_mm_data(request_ids)

    def execute(
        self, so: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        out = self.executor.execute(so, grammar_output)
        if self.request_id not in out.sampled_token_ids:
            return out
        sampled = {k: v for k, v in out.sampled_token_ids.items() if k != self.request_id}
        failure = RequestFailure("injected sampling failure", FailureKind.REQUEST, "seed")
        return ModelRunnerOutput(sampled, {**out.errors, self.request_id: failure})

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()


def test_a_failing_sample_fails_the_request_and_stops_its_siblings(llm) -> None:
    engine = rewired(llm.engine, executor=FailOneExecutor(llm.engine.core.executor, "bad#1"))
    processed = engine.input_processor.process_generate_input(_request(*CASES["text_only"]))
    engine.add_request("bad", processed, msgspec.structs.replace(SAMPLED, max_tokens=40))
    engine.add_request("fine", processed, msgspec.structs.replace(SAMPLED, n=2))
    finals = run_all(engine)
    bad = finals["bad"]
    assert bad.error == "injected sampling failure" and bad.error_kind is FailureKind.REQUEST
    assert {c.finish_reason for c in bad.outputs} == {"error"}
    assert all(c.num_tokens < 40 for c in bad.outputs)  # the siblings were stopped early
    fine = finals["fine"]
    assert fine.error is None and [c.num_tokens for c in fine.outputs] == [8, 8]
    assert_nothing_held(engine)


def test_parallel_samples_cross_the_process_seam_unchanged(llm, diverse_checkpoint_qwen2):
    prompt = _request(*CASES["one_image"])
    params = msgspec.structs.replace(SAMPLED, logprobs=2)
    local = llm.generate(prompt, params)[0]
    with LLM(model=str(diverse_checkpoint_qwen2), multiprocess=True) as remote_llm:
        remote = remote_llm.generate(prompt, params)[0]
    assert _ids(remote) == _ids(local)
    for a, b in zip(remote.outputs, local.outputs, strict=True):
        assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
