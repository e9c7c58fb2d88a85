"""The rendezvous names the rank that never came."""

from __future__ import annotations

import pytest
import torch

from mmserve.execution.parallel.rendezvous import RendezvousError, join_group
from tests.support.harness import free_port


def test_a_missing_rank_is_named_when_the_rendezvous_times_out() -> None:
    with pytest.raises(RendezvousError, match=r"waiting for rank\(s\) 1, 2 of 3"):
        join_group(
            0,
            3,
            master_addr="127.0.0.1",
            master_port=free_port(),
            timeout_s=1.0,
            device=torch.device("cpu"),
        )


def test_a_rank_that_cannot_reach_rank_0_says_where_it_looked() -> None:
    port = free_port()  # nobody listens there
    with pytest.raises(RendezvousError, match=f"rank 1 of 2 could not reach .*127.0.0.1:{port}"):
        join_group(
            1,
            2,
            master_addr="127.0.0.1",
            master_port=port,
            timeout_s=1.0,
            device=torch.device("cpu"),
        )
