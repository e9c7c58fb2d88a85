"""Decode CUDA graphs on the CPU: the ladder, padding to the next size, the padded plan, and
the whole capture/replay flow with the graph call replaced by eager execution of the same
captured callable, greedy-identical to the eager engine."""

from __future__ import annotations

import logging

import msgspec
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.config.device import DeviceConfig
from mmserve.execution.graphs.capture import EagerGraph
from mmserve.execution.graphs.decode import (
    DecodeGraphs,
    GraphMemory,
    capture_sizes,
    graph_sizes_for,
    padded_size,
    report_graph_memory,
)
from tests.support.factory import random_image, write_tiny_checkpoint
from tests.support.parity_cases import DIVERSE

triton = pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(
    not triton.knobs.runtime.interpret, reason="needs TRITON_INTERPRET=1 (tests/conftest.py)"
)


def test_the_ladder_is_vllm_like_and_stops_at_max_num_seqs() -> None:
    assert capture_sizes(256) == (
        (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64) + tuple(range(80, 257, 16))
    )
    assert capture_sizes(5) == (1, 2, 4, 5)
    assert capture_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100)
    assert capture_sizes(256, [32]) == (1, 2, 4, 8, 16, 24, 32)  # one value: the ladder to it
    assert capture_sizes(64, [3, 1, 300, 3]) == (1, 3)  # several: those, up to max_num_seqs


def test_a_batch_pads_to_the_next_captured_size() -> None:
    sizes = capture_sizes(40)
    assert [padded_size(sizes, n) for n in (1, 3, 5, 8, 9, 17, 40)] == [1, 4, 8, 8, 16, 24, 40]
    assert padded_size(sizes, 41) is None


def test_graphs_are_off_with_a_reason_unless_triton_on_cuda(caplog) -> None:
    from mmserve.layers.attention import TorchAttentionBackend
    from mmserve.layers.attention.triton_backend import TritonAttentionBackend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    args = dict(max_num_seqs=8, requested=None)
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    with caplog.at_level(logging.INFO, logger="mmserve.execution.graphs.decode"):
        assert (
            graph_sizes_for(enforce_eager=True, device=cuda, backend=triton_backend, **args) == ()
        )
        assert (
            graph_sizes_for(enforce_eager=False, device=cpu, backend=triton_backend, **args) == ()
        )
        assert (
            graph_sizes_for(enforce_eager=False, device=cuda, backend=torch_backend, **args) == ()
        )
    assert "--enforce-eager: decode CUDA graphs and encoder CUDA graphs off" in caplog.text
    assert "they need a CUDA device" in caplog.text and "not capturable" in caplog.text
    on = graph_sizes_for(enforce_eager=False, device=cuda, backend=triton_backend, **args)
    assert on == (1, 2, 4, 8)


def test_what_the_capture_took_is_logged_beside_the_reserve_and_warned_past_it(caplog) -> None:
    mib = 1 << 20
    with caplog.at_level(logging.INFO, logger="mmserve.execution.graphs.decode"):
        assert report_graph_memory(GraphMemory(40 * mib, 42 * mib), 256 * mib)
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert "took 42.0 MiB (pool 40.0 MiB, device 42.0 MiB) of the 256 MiB" in record.message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mmserve.execution.graphs.decode"):
        # the pool grew past the reserve though the device figure (another process) did not
        assert not report_graph_memory(GraphMemory(300 * mib, 10 * mib), 256 * mib)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "took 300.0 MiB" in record.message
    for flag in ("--cuda-graph-sizes", "--max-num-seqs", "--gpu-memory-utilization"):
        assert flag in record.message
    assert "--enforce-eager" in record.message


def test_the_sizes_flag_reaches_engine_args_and_is_checked() -> None:
    from tests.support.config_args import args_of

    assert args_of("--cuda-graph-sizes", "1", "8").cuda_graph_sizes == (1, 8)
    # the engine process gets its EngineConfig as JSON
    encoded = msgspec.json.encode(DeviceConfig(cuda_graph_sizes=(1, 8)))
    assert msgspec.json.decode(encoded, type=DeviceConfig).cuda_graph_sizes == (1, 8)
    assert DeviceConfig().cuda_graph_sizes is None
    for bad in ((), (0,), (2, -1), (True,)):
        with pytest.raises(ValueError, match="--cuda-graph-sizes takes batch sizes >= 1"):
            DeviceConfig(cuda_graph_sizes=bad)


@needs_interpreter
def test_the_padded_plan_has_one_tile_per_row_and_dummy_rows() -> None:
    from mmserve.layers.attention.triton_backend import DUMMY_BLOCK, TritonAttentionBackend

    graphs = DecodeGraphs((1, 2, 4, 8), 6, TritonAttentionBackend(), 16, torch.device("cpu"))
    meta = graphs.padded_metadata(4)
    assert meta.plan.num_tiles == 4 and meta.has_padding
    assert meta.plan.tile_seq_idx.tolist() == [0, 1, 2, 3]
    assert meta.plan.tile_q_start.tolist() == [0, 0, 0, 0]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.slot_mapping.tolist() == [-1] * 4  # captured storing nothing
    assert meta.block_tables.shape == (4, 6)
    # views of the backend's fixed capture buffers: what a replay reads after run() refilled
    # them, the same memory for every size
    largest = graphs.padded_metadata(8)
    assert meta.slot_mapping.data_ptr() == largest.slot_mapping.data_ptr()
    assert meta.block_tables.data_ptr() == largest.block_tables.data_ptr()
    assert (largest.block_tables == DUMMY_BLOCK).all()


def test_the_torch_backend_refuses_capture() -> None:
    from mmserve.layers.attention import TorchAttentionBackend

    with pytest.raises(ValueError, match="cannot be captured"):
        DecodeGraphs((1, 2), 4, TorchAttentionBackend(), 16, torch.device("cpu"))


IMG = "<|vision_start|><|image_pad|><|vision_end|>"
REQUESTS = [
    "Describe a red circle.",
    {"prompt": f"{IMG}What is it?", "multi_modal_data": {"image": random_image(56, 56, 1)}},
    "Count to ten:",
]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


class CountingFactory:
    """The CPU stand-in for CUDA graphs: capture runs the callable, each replay runs it again;
    the sizes captured and the replays of each are recorded."""

    def __init__(self) -> None:
        self.replays: dict[int, int] = {}

    def __call__(self, fn):
        graph = EagerGraph(fn)
        size = int(graph.output.shape[0])
        self.replays[size] = 0
        counter = self

        class Counted:
            def replay(self) -> torch.Tensor:
                counter.replays[size] += 1
                return graph.replay()

        return Counted()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("graphs"), "qwen2_vl", seed=3, **DIVERSE)


@needs_interpreter
def test_capture_and_replay_are_greedy_identical_to_the_eager_engine(checkpoint) -> None:
    engine_args = dict(
        attention_backend="triton", enable_prefix_caching=False, max_num_batched_tokens=64
    )
    with LLM(model=str(checkpoint), **engine_args) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(REQUESTS, GREEDY)]
        runner = llm.engine.core.executor.runner
        factory = CountingFactory()
        runner.capture_decode_graphs((1, 2, 4), factory)
        assert sorted(factory.replays) == [1, 2, 4]
        buffers_before = runner.buffers.input_ids.host.data_ptr()
        got = [list(o.outputs[0].token_ids) for o in llm.generate(REQUESTS, GREEDY)]
        assert runner.buffers.input_ids.host.data_ptr() == buffers_before
        # 3 decodes pad to the graph of 4; the batch shrinks to 2 and 1 as requests finish
        assert factory.replays[4] > 0
        last_slot = [kv.view(2, -1, *kv.shape[-2:])[:, -1] for kv in runner.kv_caches]
    assert got == want
    assert all(len(t) == 5 for t in got)
    assert all(bool((s == 0).all()) for s in last_slot)  # slot -1 never hit the cache's last
