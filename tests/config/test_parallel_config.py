"""ParallelConfig: tensor-parallel sizes, nodes and the refused combinations, from the flags."""

from __future__ import annotations

import pytest

from mmserve.config.parallel import ParallelConfig
from tests.support.config_args import args_of


def test_tensor_parallel_flags_reach_the_config() -> None:
    p = args_of(
        "-tp", "4", "--mm-encoder-tp-mode", "weights", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.1", "--master-port", "29500", "--headless",
        "--distributed-timeout-seconds", "30", "--worker-step-timeout", "60",
    ).engine.parallel  # fmt: skip
    assert (p.tensor_parallel_size, p.mm_encoder_tp_mode, p.nnodes, p.node_rank) == (
        4,
        "weights",
        2,
        1,
    )
    assert (p.master_addr, p.master_port, p.headless) == ("10.0.0.1", 29500, True)
    assert (p.distributed_timeout_seconds, p.worker_step_timeout) == (30.0, 60.0)
    assert p.ranks_per_node == 2 and list(p.local_ranks) == [2, 3]
    defaults = ParallelConfig()
    assert (defaults.mm_encoder_tp_mode, defaults.distributed_executor_backend) == ("data", "mp")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"distributed_executor_backend": "ray"}, "no Ray executor; use mp"),
        ({"mm_encoder_tp_mode": "pixels"}, "--mm-encoder-tp-mode must be one of"),
        ({"tensor_parallel_size": 3, "nnodes": 2, "master_port": 29500}, "must divide"),
        ({"tensor_parallel_size": 2, "nnodes": 2}, "needs --master-port"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 1, "tensor_parallel_size": 2}, "in [0, 1]"),
        ({"headless": True}, "node 0 runs the server"),
        (
            {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 1, "master_port": 29500},
            "add --headless",
        ),
        ({"master_port": 65534}, "the next two ports"),
        ({"worker_step_timeout": 0}, "--worker-step-timeout must be > 0"),
        ({"distributed_timeout_seconds": -1}, "--distributed-timeout-seconds must be > 0"),
    ],
)
def test_refused_with_the_flag_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ParallelConfig(**kwargs)
