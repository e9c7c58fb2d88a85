"""Compile the fused layer kernels for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter runs a kernel's Python; it never lowers it, so a construct the compiler refuses
(a pointer select, a cast, a layout) passes every interpreter test and fails on the first GPU.
Triton's wheel bundles ptxas, so lowering to a cubin needs no device. Run with
TRITON_INTERPRET=0 (the interpreter patches triton.language while it is on):

    TRITON_INTERPRET=0 python -m tests.layers.aot_compile
"""

from __future__ import annotations

import inspect
import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction

from mmserve.layers.fused import triton_kernels as kernels

SM90 = GPUTarget("cuda", 90, 32)
FLOAT32_ARGUMENTS = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "eps": "fp32"}
# One case per kernel, its widest branch (each compile costs a second or two): the fused residual
# add at the 7B's hidden size, and rotary on a padded head dim (80) beside 28 + 4 heads.
CASES = [
    (kernels._rms_norm_kernel, {"HAS_RESIDUAL": True, "BLOCK": 4096}),
    (kernels._silu_mul_kernel, {"BLOCK": 1024}),
    (kernels._rotary_kernel, {"HALF": 40, "HALF_PAD": 64, "HEADS_PAD": 32}),
]


def signature(fn, dtype: str) -> dict[str, str]:
    """Pointers to `dtype` (cos/sin: float32), eps float32, other arguments int32."""
    out = {}
    for name, param in inspect.signature(fn).parameters.items():
        if "constexpr" in str(param.annotation):
            out[name] = "constexpr"
        elif name in FLOAT32_ARGUMENTS:
            out[name] = FLOAT32_ARGUMENTS[name]
        else:
            out[name] = f"*{dtype}" if name.endswith("_ptr") else "i32"
    return out


def main() -> int:
    for fn, constexprs in CASES:
        for dtype in ("bf16",):  # the serving dtype; casts are what differ by dtype
            source = ASTSource(JITFunction(fn), signature(fn, dtype), constexprs=constexprs)
            compiled = compile(source, target=SM90)
            assert compiled.asm["cubin"], fn.__name__
            print(f"{fn.__name__} {dtype} {constexprs}: {len(compiled.asm['cubin'])} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
