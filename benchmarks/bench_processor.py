"""mmserve's image processor against transformers' Qwen2VLImageProcessorPil, side by side.

Usage: .venv/bin/python benchmarks/bench_processor.py [--repeats 7] [--sizes 448x448,1024x1024]

For each size both processors run on the same random RGB image (one warm-up, then `--repeats`
timed runs each: median and best wall time, and median CPU time summed over threads); outputs
are checked equal (grid_thw identical; mmserve's uint8 levels, normalised, bit-identical to
transformers' float32 values) before any timing is reported.

mmserve's API process stops at uint8 patches; the rescale and normalise run in the engine
process, on the device, just before the vision tower (`execution/encoder/normalize.py`). The
"engine normalise" column times that step alone on this CPU (torch, float32 out, the same
threads the engine would use), so that the two halves of the old work can be added up; the
last column is the bytes an image costs on the wire and in the caches (uint8 against float32).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings

import numpy as np
from PIL import Image

from mmserve.processing.image_processor import ImageProcessorConfig, process_image


def _time_ms(fn, repeats: int) -> tuple[float, float, float]:
    """(median wall, best wall, median CPU) milliseconds; CPU sums over all threads.

    Best-of-N is the steadier wall figure on a busy host; CPU time shows the work done,
    independent of how many cores were free.
    """
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall), min(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="448x448,1024x1024,3840x2160")
    parser.add_argument("--max-pixels", type=int, default=16384 * 28 * 28)
    args = parser.parse_args()

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    cfg = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=args.max_pixels)
    hf = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    print(f"# {platform.processor() or platform.machine()}, numpy {np.__version__}")
    print(f"# {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.2f}")
    head = "median / best / cpu"
    import torch

    from mmserve.execution.encoder.normalize import PixelNormalizer

    normalize = PixelNormalizer(torch.device("cpu"), torch.float32)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads for the engine step")
    print(
        f"{'size':>11} {'grid_thw':>15} {'transformers ms':>24} {'mmserve API ms':>24}  "
        f"{'speedup':>22}  {'engine normalise ms':>21}  MB uint8 / float32"
    )
    print(f"{'':>11} {'':>15} {head:>24} {head:>24}  {head:>22}  {head:>21}")
    for spec in args.sizes.split(","):
        width, height = (int(v) for v in spec.split("x"))
        rng = np.random.default_rng(0)
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))

        def run_hf(image=image):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return hf(image, return_tensors="np")

        def run_ours(image=image):
            return process_image(image, cfg)

        ref, ours = run_hf(), run_ours()
        grid = tuple(int(v) for v in ref["image_grid_thw"][0])
        assert grid == ours.grid_thw, (grid, ours.grid_thw)
        assert ours.pixel_values.dtype == np.uint8
        max_diff = float(np.abs(ref["pixel_values"] - ours.normalized()).max())
        assert max_diff == 0, max_diff
        assert torch.equal(normalize([ours]), torch.from_numpy(ref["pixel_values"]))
        hf_med, hf_best, hf_cpu = _time_ms(run_hf, args.repeats)
        our_med, our_best, our_cpu = _time_ms(run_ours, args.repeats)
        norm_med, norm_best, norm_cpu = _time_ms(lambda ours=ours: normalize([ours]), args.repeats)
        mb = ours.pixel_values.nbytes / 1e6
        print(
            f"{spec:>11} {str(grid):>15} {hf_med:7.1f} / {hf_best:6.1f} / {hf_cpu:6.1f} "
            f"{our_med:6.1f} / {our_best:6.1f} / {our_cpu:6.1f} "
            f"{hf_med / our_med:5.2f}x / {hf_best / our_best:4.2f}x / {hf_cpu / our_cpu:4.2f}x"
            f"  {norm_med:6.1f} / {norm_best:5.1f} / {norm_cpu:5.1f}  {mb:6.2f} / {4 * mb:6.2f}"
        )


if __name__ == "__main__":
    main()
