"""OutputProcessor with n > 1: n core requests gathered into one output per step, per kind."""

from __future__ import annotations

import numpy as np

from mmserve.engine.frontend.output_processor import OutputProcessor
from mmserve.engine.frontend.outputs import Logprob, OutputKind
from mmserve.errors import FailureKind, RequestFailure
from mmserve.metrics import EngineMetrics
from mmserve.sampling_params import SamplingParams
from mmserve.updates import Logprobs, RequestStatus, RequestUpdate

LENGTH, ERROR = RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ERROR
CORE_IDS = ["p#0", "p#1"]


def _decode(ids, skip_special_tokens: bool) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def _processor(kind: OutputKind, params: SamplingParams | None = None) -> OutputProcessor:
    op = OutputProcessor(_decode, EngineMetrics())
    params = params or SamplingParams(n=2)
    op.add_request("p", None, [1, 2, 3], params, kind, CORE_IDS)
    return op


def test_deltas_carry_only_the_samples_that_changed_and_finish_once_all_have() -> None:
    op = _processor(OutputKind.DELTA)
    step1 = op.process([RequestUpdate("p#0", [0]), RequestUpdate("p#1", [1])]).outputs
    assert [(c.index, c.text) for c in step1[0].outputs] == [(0, "a"), (1, "b")]
    (step2,) = op.process([RequestUpdate("p#1", [2], LENGTH)]).outputs
    assert [(c.index, c.text, c.finish_reason) for c in step2.outputs] == [(1, "c", "length")]
    assert not step2.finished
    (step3,) = op.process([RequestUpdate("p#0", [3], LENGTH)]).outputs
    assert step3.finished and [c.index for c in step3.outputs] == [0]
    assert not op.request_ids


def test_final_only_sends_every_sample_once_cumulative() -> None:
    op = _processor(OutputKind.FINAL_ONLY)
    assert op.process([RequestUpdate("p#0", [0], LENGTH), RequestUpdate("p#1", [1])]).outputs == []
    (final,) = op.process([RequestUpdate("p#1", [2], LENGTH)]).outputs
    assert final.finished and [(c.index, c.text) for c in final.outputs] == [(0, "a"), (1, "bc")]


def test_a_failing_sample_fails_the_request_and_hands_back_its_siblings() -> None:
    op = _processor(OutputKind.CUMULATIVE)
    op.process([RequestUpdate("p#0", [0]), RequestUpdate("p#1", [1])])
    failure = RequestFailure("bad image", FailureKind.REQUEST, "messages")
    step = op.process([RequestUpdate("p#1", [], ERROR, error=failure)])
    assert step.failed_ids == ["p#0"]  # for the core to finish
    (out,) = step.outputs
    assert out.finished and out.error == "bad image" and out.error_param == "messages"
    assert [c.finish_reason for c in out.outputs] == ["error", "error"]
    assert op.process([RequestUpdate("p#0", [4])]).outputs == []  # late updates are dropped


def test_abort_ends_every_unfinished_sample() -> None:
    op = _processor(OutputKind.CUMULATIVE)
    op.process([RequestUpdate("p#0", [0], LENGTH)])
    assert op.core_ids("p") == CORE_IDS
    out = op.abort("p")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["length", "abort"]
    assert not op.request_ids and op.abort("p") is None


def test_logprob_arrays_become_token_dicts_and_add_up() -> None:
    op = _processor(OutputKind.CUMULATIVE, SamplingParams(n=2, logprobs=2))
    lp = Logprobs(
        token_ids=np.array([[4, 4, 7], [9, 1, 2]], dtype=np.int32),
        logprobs=np.array([[-0.1, -0.1, -2.5], [-3.0, -0.5, -1.0]], dtype=np.float32),
        ranks=np.array([1, 3], dtype=np.int32),
    )
    (out,) = op.process([RequestUpdate("p#1", [4, 9], logprobs=lp)]).outputs
    seq = out.outputs[1]
    assert seq.logprobs[0] == {
        4: Logprob(np.float32(-0.1).item(), 1, "e"),
        7: Logprob(-2.5, 2, "h"),
    }
    assert list(seq.logprobs[1]) == [9, 1, 2] and seq.logprobs[1][9].rank == 3
    assert seq.cumulative_logprob == np.float32(-0.1).item() + -3.0
    assert out.outputs[0].logprobs == [] and out.outputs[0].cumulative_logprob == 0.0


def test_several_steps_delivered_at_once_add_up() -> None:
    # an engine process may hand over two of its steps in one batch of updates
    for kind in (OutputKind.DELTA, OutputKind.CUMULATIVE):
        op = _processor(kind, SamplingParams(n=2, logprobs=0))
        lp = Logprobs(
            np.array([[5]], dtype=np.int32), np.array([[-1.0]], dtype=np.float32), np.ones(1, "i4")
        )
        updates = [RequestUpdate("p#0", [0], logprobs=lp), RequestUpdate("p#0", [1], logprobs=lp)]
        (out,) = op.process(updates).outputs
        seq = out.outputs[0]
        assert (seq.text, seq.token_ids, seq.delta_text, seq.delta_token_ids) == (
            "ab",
            [0, 1],
            "ab",
            [0, 1],
        )
        assert len(seq.logprobs) == 2 and seq.cumulative_logprob == -2.0
