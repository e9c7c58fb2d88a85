"""The engine's intra-op threads: --cpu-threads, OMP_NUM_THREADS and the CPU default (every core
split between the replicas when idle threads sleep, every core but the API's when they spin)."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM
from mmserve.config.device import DeviceConfig
from mmserve.config.model import bundled_toy_model_dir
from mmserve.cpu_threads import engine_cpu_threads
from mmserve.engine.frontend.core_client import engine_env


@pytest.mark.parametrize(
    ("replicas", "environ", "cpus", "want"),
    [
        (1, {"OMP_WAIT_POLICY": "PASSIVE"}, 2, 2),  # the server's default on this machine
        (1, {"OMP_WAIT_POLICY": "passive"}, 8, 8),
        (2, {"OMP_WAIT_POLICY": "PASSIVE"}, 8, 4),  # -dp 2 splits the cores
        (3, {"OMP_WAIT_POLICY": "PASSIVE"}, 2, 1),  # never fewer than one
        (1, {}, 2, 1),  # spinning threads: one core left to the API process
        (1, {"OMP_WAIT_POLICY": "ACTIVE"}, 8, 7),
        (1, {}, 1, 1),
        (2, {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}, 8, 3),  # the user's word
    ],
)
def test_the_engines_share_of_the_cpus(replicas, environ, cpus, want) -> None:
    assert engine_cpu_threads(replicas, environ, cpus) == want


def test_the_engine_process_starts_with_sleeping_threads_unless_told_otherwise() -> None:
    assert engine_env({"PATH": "/bin"}, None) == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_env({"OMP_WAIT_POLICY": "ACTIVE"}, None)["OMP_WAIT_POLICY"] == "ACTIVE"
    extra = {"OMP_WAIT_POLICY": "ACTIVE", "CUDA_VISIBLE_DEVICES": "1"}
    assert engine_env({}, extra) == extra


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_a_bad_thread_count_is_refused_by_flag_name(bad) -> None:
    with pytest.raises(ValueError, match="--cpu-threads"):
        DeviceConfig(cpu_threads=bad)


def test_cpu_threads_sets_an_in_process_engines_threads() -> None:
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        llm = LLM(model=str(bundled_toy_model_dir()), device="cpu", cpu_threads=want)
        assert torch.get_num_threads() == want
        del llm
    finally:
        torch.set_num_threads(before)
