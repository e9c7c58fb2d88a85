"""Parallelism configuration: tensor-parallel ranks, their nodes and rendezvous, and the
engine's processes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mmserve.config.device import DEVICE
from mmserve.config.flags import check_choice, check_seconds, flag

MM_ENCODER_TP_MODES = ("data", "weights")
EXECUTOR_BACKENDS = ("mp", "ray")
MAX_PORT = 65535
# ZMQ sockets of a multi-node run, next to the rendezvous port (`steps_port`, `answers_port`)
STEPS_PORT_OFFSET = 1
ANSWERS_PORT_OFFSET = 2


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine is laid out over processes, devices and nodes.

    Tensor parallelism (`--tensor-parallel-size N`): N worker processes, one per device, each
    holding its shard; the engine core (on node 0) broadcasts every step to them. With
    `--nnodes M` the ranks are spread evenly, N / M per node; node 0 runs the API server and
    the engine core, the others run `mmserve serve --headless` (their ranks only)."""

    tensor_parallel_size: int = flag(
        1,
        type=int,
        group=DEVICE,
        aliases=("-tp",),
        help="Devices (worker processes) to split the model over, one rank each: cuda:0.. on "
        "GPUs (NCCL), all on the CPU otherwise (gloo). Default {default}.",
    )
    pipeline_parallel_size: int = flag(
        1,
        type=int,
        group=DEVICE,
        aliases=("-pp",),
        help="Pipeline stages; {default} (larger values are refused at start-up).",
    )
    data_parallel_size: int = flag(
        1,
        type=int,
        group=DEVICE,
        aliases=("-dp",),
        help="Engine replicas behind this server, each an engine process with the whole model "
        "on a device of its own (CUDA: device i for replica i; CPU: the cores split between "
        "them). A request goes to the replica its first item's identity (or its prompt's "
        "first block) ranks first, unless that replica is over the load bound "
        "(--data-parallel-load-slack). Default {default}.",
    )
    # epsilon of the load bound: a replica carrying more than (1 + epsilon) x the mean number
    # of unfinished requests (counting the new one) is passed over (docs/data_parallel.md).
    data_parallel_load_slack: float = flag(
        0.5,
        type=float,
        group=DEVICE,
        help="With --data-parallel-size > 1: a replica is passed over while it has more than "
        "(1 + this) x the mean number of unfinished requests per replica, the new one counted. "
        "Smaller balances more tightly and encodes a repeated picture on more replicas. "
        "Default {default}.",
    )
    # The vision tower under TP (issue #34): replicated with the step's items split across
    # ranks, or sharded like the decoder.
    mm_encoder_tp_mode: str = flag(
        "data",
        choices=MM_ENCODER_TP_MODES,
        group=DEVICE,
        help="The vision tower with --tensor-parallel-size > 1. data: every rank holds the "
        "whole tower and a step's items are split across ranks by patch cost, the embeddings "
        "gathered; weights: the tower is sharded (heads and MLP) and every rank encodes every "
        "item. Default {default}.",
    )
    distributed_executor_backend: str = flag(
        "mp",
        choices=EXECUTOR_BACKENDS,
        group=DEVICE,
        help="How the tensor-parallel workers are started: mp (one process per rank, spawned "
        "by the engine, or by `--headless` on other nodes). ray is refused (not built).",
    )
    nnodes: int = flag(
        1,
        type=int,
        group=DEVICE,
        help="Machines the tensor-parallel ranks span; each runs --tensor-parallel-size / "
        "--nnodes ranks. Default {default}.",
    )
    node_rank: int = flag(
        0,
        type=int,
        group=DEVICE,
        help="This machine's index among --nnodes: 0 runs the server and the engine, the "
        "others run --headless. Default {default}.",
    )
    master_addr: str = flag(
        "127.0.0.1",
        group=DEVICE,
        help="Node 0's address, which every rank reaches: the rendezvous (torch.distributed) "
        "at --master-port, the steps at --master-port + 1 and the answers at --master-port + "
        "2 (ZMQ). Default {default}.",
    )
    master_port: int | None = flag(
        None,
        type=int,
        group=DEVICE,
        help="Node 0's rendezvous port (it also uses the next two, see --master-addr). "
        "Required with --nnodes > 1; on one node, default: free ports picked at start-up.",
    )
    headless: bool = flag(
        False,
        action="store_true",
        group=DEVICE,
        help="Run no API server and no engine core: start this node's tensor-parallel ranks, "
        "which join node 0's engine (--node-rank > 0 with --nnodes > 1, and the same model and "
        "flags as node 0).",
    )
    distributed_timeout_seconds: float = flag(
        300.0,
        type=float,
        group=DEVICE,
        help="How long the ranks wait for each other at start-up (the rendezvous) before "
        "giving up with the missing ranks named. Default {default} s.",
    )
    # A hung worker (issue #34): a step that no answer ends is a dead engine, not a hang.
    worker_step_timeout: float = flag(
        600.0,
        type=float,
        group=DEVICE,
        help="With --tensor-parallel-size > 1: the longest one step may take on the workers; "
        "a rank that has not answered by then is taken as hung and the engine stops (every "
        "request gets an error). Default {default} s.",
    )
    # The scheduler and the model in an engine process of their own (issue #14). None: the
    # entry point's default (the server: yes; the offline LLM: no, unless data-parallel).
    multiprocess: bool | None = flag(
        None,
        action=argparse.BooleanOptionalAction,
        group=DEVICE,
        help="Run the scheduler and the model in an engine process, apart from the HTTP server "
        "and its media processing (default on for `serve`). --no-multiprocess keeps one process "
        "(and one replica: --data-parallel-size > 1 needs engine processes).",
    )

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            flag_name = "--" + name.replace("_", "-")
            if not _is_positive_int(value):
                raise ValueError(f"{flag_name} must be a positive integer, got {value!r}")
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                f"--pipeline-parallel-size {self.pipeline_parallel_size}: mmserve does not run "
                "pipeline stages yet; use --pipeline-parallel-size 1 (--tensor-parallel-size "
                "splits a model over devices)"
            )
        if (
            self.data_parallel_size > 1
            and self.tensor_parallel_size > 1
            and (self.nnodes > 1 or self.master_port is not None)
        ):
            # Replicas of a tensor-parallel model run on this node, each group's rendezvous on
            # a port of its own picked at start-up: one --master-port cannot serve them all.
            raise ValueError(
                f"--data-parallel-size {self.data_parallel_size} with --tensor-parallel-size "
                f"{self.tensor_parallel_size} runs every replica's ranks on this node, each "
                "group on free ports picked at start-up; drop --nnodes and --master-port"
            )
        slack = self.data_parallel_load_slack
        if isinstance(slack, bool) or not isinstance(slack, int | float) or not slack >= 0:
            raise ValueError(
                "--data-parallel-load-slack is the epsilon of the load bound (a replica over "
                f"(1 + epsilon) x the mean load is passed over), a number >= 0; got {slack!r}"
            )
        if self.data_parallel_size > 1 and self.multiprocess is False:
            raise ValueError(
                f"--data-parallel-size {self.data_parallel_size} runs one engine process per "
                "replica, but --no-multiprocess (multiprocess=False) keeps the engine in this "
                "process; drop --no-multiprocess, or use --data-parallel-size 1"
            )
        check_choice("mm_encoder_tp_mode", self.mm_encoder_tp_mode, MM_ENCODER_TP_MODES)
        check_choice(
            "distributed_executor_backend", self.distributed_executor_backend, EXECUTOR_BACKENDS
        )
        if self.distributed_executor_backend == "ray":
            raise ValueError(
                "--distributed-executor-backend ray: mmserve has no Ray executor; use mp (the "
                "default: one process per rank, --nnodes/--headless for several machines)"
            )
        check_seconds("distributed_timeout_seconds", self.distributed_timeout_seconds)
        check_seconds("worker_step_timeout", self.worker_step_timeout)
        self._check_nodes()

    def _check_nodes(self) -> None:
        size, nnodes = self.tensor_parallel_size, self.nnodes
        if not _is_positive_int(nnodes):
            raise ValueError(f"--nnodes must be a positive integer, got {nnodes!r}")
        if size % nnodes:
            raise ValueError(
                f"--nnodes {nnodes} must divide --tensor-parallel-size {size}: every node runs "
                "the same number of ranks"
            )
        if not (isinstance(self.node_rank, int) and 0 <= self.node_rank < nnodes):
            raise ValueError(
                f"--node-rank must be in [0, {nnodes - 1}] for --nnodes {nnodes}, got "
                f"{self.node_rank!r}"
            )
        port = self.master_port
        if port is not None and not (
            _is_positive_int(port) and port + ANSWERS_PORT_OFFSET <= MAX_PORT
        ):
            raise ValueError(
                f"--master-port must be in [1, {MAX_PORT - ANSWERS_PORT_OFFSET}] (the next two "
                f"ports carry the steps and the answers), got {port!r}"
            )
        if nnodes > 1 and port is None:
            raise ValueError(
                f"--nnodes {nnodes} needs --master-port (and --master-addr, node 0's address "
                "every node reaches): the nodes meet there"
            )
        if self.headless and self.node_rank == 0:
            raise ValueError(
                "--headless runs the ranks of a node other than node 0 (--node-rank 1.. with "
                "--nnodes > 1); node 0 runs the server"
            )
        if nnodes > 1 and self.node_rank > 0 and not self.headless:
            raise ValueError(
                f"--node-rank {self.node_rank}: nodes other than 0 run no server; add --headless"
            )
        if not self.master_addr or not isinstance(self.master_addr, str):
            raise ValueError("--master-addr must be node 0's host name or address")

    @property
    def uses_engine_processes(self) -> bool:
        """Whether the engine core(s) run in engine processes: asked for, or implied by more
        than one replica (the offline LLM's default is in-process)."""
        return bool(self.multiprocess) or self.data_parallel_size > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
