"""Device and parallelism configuration: where the model runs, graphs, attention, processes."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.config.flags import check_choice, flag

DEVICES = ("auto", "cpu", "cuda")
OPTIMIZATION_LEVELS = (0, 1, 2, 3)  # vLLM's -O levels
# Inductor's artefacts (--compile-cache-dir), kept across restarts.
DEFAULT_COMPILE_CACHE_DIR = "~/.cache/mmserve/torch_compile"
ATTENTION_BACKENDS = ("auto", "torch", "triton")
DEVICE = "Device and parallelism"


def device_flag() -> str:
    """--device, as `serve` and `encode` both take it."""
    return flag("auto", choices=DEVICES, group=DEVICE, help="Where to run; auto: cuda if present.")


@dataclass(frozen=True)
class DeviceConfig:
    """The one device a model runs on, its memory share, and how steps run there (graphs,
    attention backend)."""

    device: str = device_flag()
    gpu_memory_utilization: float = flag(
        0.9,
        type=float,
        group=DEVICE,
        help="Fraction of the GPU's memory mmserve may use (weights, activations, KV cache): "
        "a profile run at start-up measures the activation peak of the largest step, and the "
        "KV cache gets what the weights, that peak and a CUDA graph reserve leave. CUDA only "
        "(on the CPU --kv-cache-memory-bytes sizes the cache). Default {default}.",
    )
    # Decode CUDA graphs (issue #15): captured at start-up on CUDA with the Triton backend
    # unless --enforce-eager.
    enforce_eager: bool = flag(
        False,
        action="store_true",
        group=DEVICE,
        help="Turn off the decode CUDA graphs (captured at start-up, CUDA with the triton "
        "attention backend only) and the encoder CUDA graphs (--enable-encoder-cuda-graph): "
        "every step runs eagerly, and the KV sizing keeps no CUDA graph reserve.",
    )
    # None: the ladder up to max_num_seqs; one value: the ladder up to it; several: exactly
    # those (vLLM's --cuda-graph-sizes).
    cuda_graph_sizes: tuple[int, ...] | None = flag(
        None,
        type=int,
        nargs="+",
        group=DEVICE,
        help="Decode batch sizes to capture as CUDA graphs. One value: 1, 2, 4, 8, then steps "
        "of 8 to 64 and of 16 up to it; several: exactly those. Default: that ladder up to "
        "--max-num-seqs. A decode step pads to the next captured size.",
    )
    # Vision encoder CUDA graphs (issue #15): off until measured faster, as in vLLM and SGLang.
    enable_encoder_cuda_graph: bool = flag(
        False,
        action="store_true",
        group=DEVICE,
        help="Replay CUDA graphs of the vision encoder: a call is padded to the next of a ladder "
        "of sizes (256 input patches, doubling, up to the encoder budget), each captured on "
        "first use. CUDA and bfloat16/float16 only; --enforce-eager turns it off. Default off.",
    )
    # torch.compile of the vision blocks and decoder layers (issue #37, execution/compile.py):
    # vLLM's -O spelling. None: mmserve's default, eager (compiling measured no faster on CPU).
    optimization_level: int | None = flag(
        None,
        type=int,
        choices=OPTIMIZATION_LEVELS,
        group=DEVICE,
        aliases=("-O",),
        help="vLLM's optimization level. -O0: nothing compiled and no CUDA graphs (as "
        "--enforce-eager); -O1, -O2, -O3 (the same in mmserve): the vision blocks and decoder "
        "layers compiled by torch.compile (inductor; attention stays eager), at start-up, with "
        "the CUDA graphs as usual. Default: not compiled (docs/compile.md: why).",
    )
    compile_cache_dir: str = flag(
        DEFAULT_COMPILE_CACHE_DIR,
        group=DEVICE,
        metavar="DIR",
        help="Where torch.compile (-O1..-O3) keeps inductor's compiled artefacts, reused by the "
        "next start with the same model shapes and torch. Default {default}.",
    )
    # Language-model attention (issue #15): auto is triton on CUDA, torch (SDPA) elsewhere.
    attention_backend: str = flag(
        "auto",
        choices=ATTENTION_BACKENDS,
        group=DEVICE,
        help="Language-model attention: triton (Triton kernels, CUDA; on the CPU only with "
        "TRITON_INTERPRET=1) or torch (SDPA, any device). auto: triton on CUDA, else torch.",
    )

    # None: on a CPU every core, split between -dp replicas (cpu_threads.py).
    cpu_threads: int | None = flag(
        None,
        type=int,
        group=DEVICE,
        metavar="N",
        help="torch intra-op threads of each engine process. Default on a CPU: every core, "
        "split between the data-parallel replicas, with idle threads sleeping "
        "(OMP_WAIT_POLICY=PASSIVE) so the API process gets a core when it needs one; "
        "OMP_NUM_THREADS in the environment sets it too. Default on CUDA: torch's.",
    )

    def __post_init__(self) -> None:
        check_choice("device", self.device, DEVICES)
        if self.cpu_threads is not None and not _is_positive_int(self.cpu_threads):
            raise ValueError(f"--cpu-threads takes a thread count >= 1; got {self.cpu_threads!r}")
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.optimization_level is not None and (
            isinstance(self.optimization_level, bool)
            or self.optimization_level not in OPTIMIZATION_LEVELS
        ):
            raise ValueError(
                f"--optimization-level (-O) takes 0, 1, 2 or 3; got {self.optimization_level!r}"
            )
        if not self.compile_cache_dir:
            raise ValueError("--compile-cache-dir needs a directory")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                "--gpu-memory-utilization is the fraction of the GPU's memory mmserve may use, "
                f"in (0, 1]; got {self.gpu_memory_utilization}"
            )
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes)
            if not sizes or not all(_is_positive_int(s) for s in sizes):
                raise ValueError(
                    "--cuda-graph-sizes takes batch sizes >= 1 (one: capture the ladder up to "
                    f"it; several: exactly those), e.g. --cuda-graph-sizes 1 2 4 8; got {sizes!r}"
                )
            object.__setattr__(self, "cuda_graph_sizes", sizes)

    @property
    def compiles_model(self) -> bool:
        """-O1..-O3: the vision blocks and decoder layers run compiled."""
        return self.optimization_level is not None and self.optimization_level >= 1

    @property
    def runs_eager(self) -> bool:
        """No CUDA graphs: --enforce-eager, or -O0 (vLLM's "no compilation, no cudagraphs")."""
        return self.enforce_eager or self.optimization_level == 0


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
