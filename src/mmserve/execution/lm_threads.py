"""How many intra-op threads a step's language-model work takes on a CPU.

The engine process takes every core, its idle threads asleep (`mmserve/cpu_threads.py`): the
vision tower's large matmuls and attention keep them all busy. A decode step of a small model
is another matter: each of its hundreds of ops is a few microseconds of work, and one that
splits it across threads pays a wake-up of a sleeping thread each time. On the benchmark
checkpoint (2 cores, 16 sequences) a decode step on two threads took 1.5-1.8x the wall time
and twice the CPU of the same step on one, CPU the API process needed.

So a step whose language-model work is small (tokens x multiply-adds per token below
`MIN_PARALLEL_MACS`, ~1-2 ms of one core) runs its forward, logits and sampling on one
thread; a larger one (a prefill, or any step of a real checkpoint: one token of a 2B model is
1.5G multiply-adds) keeps every thread. A GPU's steps are untouched. The thread count
changes the order of no float sum a step's results depend on: each output element of a
matmul or a reduction is computed by one thread either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

# Below this many multiply-adds a forward is about 1-2 ms of one core's work: short enough
# that waking the other threads for each of its ops costs more than they save.
MIN_PARALLEL_MACS = 32 * 2**20


def lm_macs_per_token(model: nn.Module) -> int:
    """About the multiply-adds per token of the language model: the elements of its matrix
    weights, the vision tower's (`visual`) and the embedding tables' (read, not multiplied)
    left out."""
    macs = 0
    for name, module in model.named_modules():
        in_tower = name == "visual" or name.startswith("visual.")
        if in_tower or "embed" in type(module).__name__.lower():
            continue
        for param in module.parameters(recurse=False):
            if param.dim() == 2:
                macs += param.numel()
    return macs


class LMThreads:
    """A context per step: on a CPU, one intra-op thread while a small step's language-model
    work runs (module docstring); the caller's count back afterwards, errors included."""

    def __init__(
        self,
        device: torch.device,
        macs_per_token: int,
        min_parallel_macs: int = MIN_PARALLEL_MACS,
    ) -> None:
        self.on_cpu = device.type == "cpu"
        self.macs_per_token = macs_per_token
        self.min_parallel_macs = min_parallel_macs

    def single_thread(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs its language model on one thread."""
        return self.on_cpu and num_tokens * self.macs_per_token < self.min_parallel_macs

    def threads_for(self, num_tokens: int) -> int:
        """The intra-op threads a step of `num_tokens` tokens runs its language model on."""
        return 1 if self.single_thread(num_tokens) else torch.get_num_threads()

    def step(self, num_tokens: int) -> AbstractContextManager[None]:
        return intra_op_threads(self.threads_for(num_tokens))


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` inside; the caller's back afterwards
    (errors included). Setting it costs well under a microsecond."""
    before = torch.get_num_threads()
    if threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
