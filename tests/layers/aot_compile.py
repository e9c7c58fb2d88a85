"""Compile every Triton kernel for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter runs a kernel's Python; it never lowers it, so a construct the compiler refuses
(a pointer select, a cast, a layout, a block too large for the registers of its warps) passes
every interpreter test and fails on the first GPU. Triton's wheel bundles ptxas, so lowering to
a cubin needs no device. Each case is compiled with the constexprs and `num_warps` the engine's
launch computes (the `*_specialisation` functions next to each launch), at the shapes it serves.
Run with TRITON_INTERPRET=0 (the interpreter patches triton.language while it is on):

    TRITON_INTERPRET=0 python -m tests.layers.aot_compile          # the distinct lowerings
    TRITON_INTERPRET=0 python -m tests.layers.aot_compile --all    # every specialisation
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction

from mmserve.layers.attention import triton_kernels as attention
from mmserve.layers.attention.triton_backend import (
    QUERY_TOKENS_PER_TILE,
    paged_attention_specialisation,
    store_kv_specialisation,
)
from mmserve.layers.fused import triton_kernels as fused
from mmserve.layers.fused.triton_ops import (
    rms_norm_specialisation,
    rotary_specialisation,
    silu_mul_specialisation,
)

SM90 = GPUTarget("cuda", 90, 32)
SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one H100/H200 block may use
TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Arguments that are not the kernel's data dtype or a plain int32.
FIXED_TYPES = {
    "cos_ptr": "*fp32",
    "sin_ptr": "*fp32",
    "eps": "fp32",
    "scale": "fp32",
    "slot_mapping_ptr": "*i64",
    "block_tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "tile_seq_idx_ptr": "*i32",
    "tile_q_start_ptr": "*i32",
}
# Qwen2-VL-7B: hidden 3584, MLP 18944, 28 query heads over 4 KV heads of 128 (GQA group 7).
HIDDEN_7B, INTERMEDIATE_7B, HEADS_7B, KV_HEADS_7B, HEAD_DIM_7B = 3584, 18944, 28, 4, 128
# Head dims: powers of two and not (24 in 32, 72 and 80 in 128: masked tails)
HEAD_DIMS, BLOCK_SIZES, GROUPS = (24, 64, 72, 80, 128), (16, 32), (1, 2, 4, 7)
KV_HEADS = 4  # query heads = group x 4, as the 7B's 28 / 4


class Case(NamedTuple):
    fn: Callable[..., Any]
    dtype: torch.dtype
    specialisation: dict[str, Any]  # constexprs, and num_warps when the launch sets it

    def describe(self) -> str:
        spec = ", ".join(f"{k}={v}" for k, v in self.specialisation.items())
        return f"{self.fn.__name__} {TRITON_DTYPES[self.dtype]} {spec}"


def signature(fn: Callable[..., Any], dtype: torch.dtype) -> dict[str, str]:
    """Pointers to the data dtype, the fixed types above, other arguments int32."""
    out = {}
    for name, param in inspect.signature(fn).parameters.items():
        if "constexpr" in str(param.annotation):
            out[name] = "constexpr"
        elif name in FIXED_TYPES:
            out[name] = FIXED_TYPES[name]
        else:
            out[name] = f"*{TRITON_DTYPES[dtype]}" if name.endswith("_ptr") else "i32"
    return out


def fused_cases() -> list[Case]:
    """The layer ops at 7B widths in bfloat16 (their casts are what differ by dtype): the fused
    residual add over 3584 columns (8 warps), SwiGLU's column blocks, rotary on 128 and on
    padded 80-, 72- and 24-dim heads beside 28 + 4 heads."""
    bf16 = torch.bfloat16
    return [
        Case(fused._rms_norm_kernel, bf16, rms_norm_specialisation(HIDDEN_7B, has_residual=True)),
        Case(fused._silu_mul_kernel, bf16, silu_mul_specialisation(INTERMEDIATE_7B)),
        Case(fused._rotary_kernel, bf16, rotary_specialisation(HEAD_DIM_7B, HEADS_7B, 4)),
        Case(fused._rotary_kernel, bf16, rotary_specialisation(80, HEADS_7B, 4)),
        Case(fused._rotary_kernel, bf16, rotary_specialisation(72, HEADS_7B, 4)),
        Case(fused._rotary_kernel, bf16, rotary_specialisation(24, HEADS_7B, 4)),
    ]


def _attention(head_dim: int, block_size: int, group: int, dtype: torch.dtype) -> list[Case]:
    paged = paged_attention_specialisation(
        group * KV_HEADS,
        KV_HEADS,
        head_dim,
        block_size,
        QUERY_TOKENS_PER_TILE,
        dtype,
        is_interpreted=False,
    )
    store = store_kv_specialisation(KV_HEADS, head_dim, block_size)
    return [Case(attention._paged_attention_kernel, dtype, paged)] + (
        [Case(attention._store_kv_kernel, dtype, store)] if group == 1 else []
    )


def attention_cases(exhaustive: bool) -> list[Case]:
    """The paged attention and KV store specialisations the engine launches. By default the
    ones whose lowering differs: the 7B's (group 7 padded to 8, head 128, 8 warps, bf16),
    float32's IEEE dot, a masked head dim (80 in 128) with float16 and 32-token blocks,
    group 4 at 4 warps (the 8192-element boundary), the masked head dims 72 (in 128) and
    24 (in 32) in bf16, and the widest head start-up accepts (256); `exhaustive`: every head
    dim, block size, dtype and group."""
    if exhaustive:
        grid = itertools.product(HEAD_DIMS, BLOCK_SIZES, GROUPS, TRITON_DTYPES)
        return [case for args in grid for case in _attention(*args)]
    chosen = [
        (128, 16, 7, torch.bfloat16),
        (64, 16, 2, torch.float32),
        (80, 32, 1, torch.float16),
        (128, 32, 4, torch.bfloat16),
        (72, 16, 4, torch.bfloat16),
        (24, 32, 1, torch.bfloat16),
        (256, 16, 4, torch.bfloat16),  # MAX_HEAD_DIM: the widest head start-up accepts
    ]
    cases = [case for args in chosen for case in _attention(*args)]
    # the 7B's KV store (group 7 adds none above): bf16, 4 KV heads of 128
    cases.append(
        Case(
            attention._store_kv_kernel,
            torch.bfloat16,
            store_kv_specialisation(KV_HEADS_7B, HEAD_DIM_7B, 16),
        )
    )
    return cases


def compile_case(case: Case) -> int:
    """Lower one case to an sm_90 cubin within the shared memory a block may use; its size in
    bytes."""
    constexprs = {k: v for k, v in case.specialisation.items() if k != "num_warps"}
    options = {"num_warps": case.specialisation.get("num_warps", 4)}
    source = ASTSource(JITFunction(case.fn), signature(case.fn, case.dtype), constexprs=constexprs)
    compiled = compile(source, target=SM90, options=options)
    cubin = compiled.asm["cubin"]
    assert cubin, case.describe()
    shared_bytes = compiled.metadata.shared
    assert shared_bytes <= SM90_SHARED_BYTES, f"{case.describe()}: {shared_bytes} B shared"
    return len(cubin)


def all_cases(exhaustive: bool) -> Iterator[Case]:
    yield from fused_cases()
    yield from attention_cases(exhaustive)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every attention specialisation")
    args = ap.parse_args(argv)
    failed = 0
    for case in all_cases(args.all):
        start = time.perf_counter()
        try:
            size = compile_case(case)
        except Exception as exc:  # noqa: BLE001 - every case is reported, then the exit code
            failed += 1
            sys.stdout.write(f"FAILED {case.describe()}: {type(exc).__name__}: {exc}\n")
            continue
        seconds = time.perf_counter() - start
        sys.stdout.write(f"{case.describe()}: {size} bytes in {seconds:.1f} s\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
