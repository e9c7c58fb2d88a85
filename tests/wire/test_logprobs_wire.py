"""Logprobs on the wire: arrays checked on both ends, carried through the in-process twins."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.scheduling.outputs import Logprobs, ModelRunnerOutput, RequestUpdate
from mmserve.scheduling.request import RequestStatus
from mmserve.wire import codec
from mmserve.wire.common import WireError, WireLogprobs
from mmserve.wire.convert import (
    runner_output_from_wire,
    runner_output_to_wire,
    update_from_wire,
    update_to_wire,
)
from mmserve.wire.engine_core import EngineCoreOutput, EngineCoreOutputs
from mmserve.wire.executor import WireModelRunnerOutput
from tests.wire.samples import logprobs


def _lp(num_tokens: int, num_top: int) -> Logprobs:
    w = logprobs(num_tokens, num_top)
    return Logprobs(w.token_ids, w.logprobs, w.ranks)


def test_an_update_with_logprobs_survives_the_wire_exactly() -> None:
    lp = _lp(2, 3)
    update = RequestUpdate("r#1", [5, 6], RequestStatus.FINISHED_LENGTH, logprobs=lp)
    msg = codec.decode(codec.encode(EngineCoreOutputs([update_to_wire(update)])))
    back = update_from_wire(msg.outputs[0])
    assert back.logprobs is not None
    for name in ("token_ids", "logprobs", "ranks"):
        got, sent = getattr(back.logprobs, name), getattr(lp, name)
        assert got.dtype == sent.dtype and np.array_equal(got, sent), name
    runner = ModelRunnerOutput({"a": [1]}, {}, {"a": _lp(1, 0)})
    wire = codec.decode(codec.encode(runner_output_to_wire(runner)))
    assert np.array_equal(
        runner_output_from_wire(wire).logprobs["a"].token_ids, runner.logprobs["a"].token_ids
    )


@pytest.mark.parametrize(
    "build",
    [
        lambda w: WireLogprobs(w.token_ids.astype(np.int64), w.logprobs, w.ranks),
        lambda w: WireLogprobs(w.token_ids, w.logprobs.astype(np.float64), w.ranks),
        lambda w: WireLogprobs(w.token_ids, w.logprobs[:, :1], w.ranks),
        lambda w: WireLogprobs(w.token_ids, w.logprobs, w.ranks[:1]),
        lambda w: WireLogprobs(w.token_ids[:, :0], w.logprobs[:, :0], w.ranks),
        lambda w: WireLogprobs(-w.token_ids - 1, w.logprobs, w.ranks),
        lambda w: WireLogprobs(w.token_ids, w.logprobs, w.ranks * 0),
        lambda w: EngineCoreOutput("r", [1], logprobs=w),  # 2 rows for 1 token
        lambda w: WireModelRunnerOutput({"r": [1, 2, 3]}, {}, {"r": w}),
    ],
)
def test_inconsistent_logprobs_are_wire_errors(build) -> None:
    with pytest.raises(WireError):
        build(logprobs(2, 3))
