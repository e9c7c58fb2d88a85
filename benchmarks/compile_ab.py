"""torch.compile (-O3) against eager on this machine: ViT and decode step, paired A/B.

    python benchmarks/compile_ab.py --out /tmp/compile_ab.json             # tiny and 2B-sized
    python benchmarks/compile_ab.py --shapes mid --layers 2 --pairs 5      # 2B-sized layers only

Shapes: `tiny` (the tests' tiny Qwen2-VL) and `mid` (Qwen2-VL-2B's layer widths, `--layers`
deep). Each row: the compile time, eager and compiled medians, and the median of the per-pair
ratios eager / compiled (> 1: compiled is faster), which a loaded machine disturbs least.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for entry in (str(REPO / "src"), str(REPO)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

from benchmarks.suite.compile_ab import MID_2B, compare_compile  # noqa: E402

SHAPES = {"tiny": {}, "mid": MID_2B}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny,mid", help="comma-separated: tiny, mid")
    ap.add_argument("--layers", type=int, default=2, help="vision blocks and decoder layers")
    ap.add_argument("--image", default="448x448", help="the ViT's image, WIDTHxHEIGHT")
    ap.add_argument("--batches", default="1,16", help="decode batch sizes")
    ap.add_argument("--pairs", type=int, default=9, help="eager/compiled pairs per row")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    width, height = (int(v) for v in args.image.split("x"))
    results = {}
    for name in args.shapes.split(","):
        results[name] = compare_compile(
            SHAPES[name],
            layers=args.layers,
            image=(width, height),
            decode_batches=tuple(int(b) for b in args.batches.split(",")),
            pairs=args.pairs,
            device=args.device,
            dtype=args.dtype,
        )
        print(json.dumps({name: results[name]}, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
