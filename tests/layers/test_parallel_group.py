"""TPGroup's collectives on two gloo ranks, and the identity they are on one."""

import pytest
import torch

from mmserve.layers.parallel import SINGLE, TPGroup
from tests.support.distributed import run_ranks


def _collectives(group: TPGroup) -> tuple[list[float], list[int], list[float]]:
    summed = group.all_reduce(torch.full((2,), float(group.rank + 1))).tolist()
    gathered = group.all_gather(torch.tensor([group.rank * 10]), dim=0).tolist()
    sent = group.broadcast(torch.tensor([7.0]) if group.rank == 1 else torch.zeros(1), src=1)
    return summed, gathered, sent.tolist()


def test_collectives_on_two_ranks() -> None:
    assert run_ranks(_collectives, 2) == [([3.0, 3.0], [0, 10], [7.0])] * 2


def test_single_is_the_identity_without_torch_distributed() -> None:
    x = torch.arange(3.0)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x and SINGLE.broadcast(x) is x
    assert SINGLE.is_first


def test_a_group_checks_its_rank() -> None:
    with pytest.raises(ValueError, match="outside"):
        TPGroup(rank=2, size=2, group=object())
    with pytest.raises(ValueError, match="torch.distributed group"):
        TPGroup(rank=0, size=2)
