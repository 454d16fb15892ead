"""Launch shapes of the tensor-wide amax pass (the first of a quantize's two passes).

    python benchmarks/sweep_amax.py [--rows 8192 --cols 4096]

For each (elements a program reads per iteration, programs per SM, warps) of
kernels.amax.AMAX_LAUNCH: the pass's time over x [rows, cols] bf16 from a CUDA graph, its read
bandwidth over the copy's (2 bytes an element read, against the copy's read + write), and the
NVFP4 quantize with the pass included (`nvfp4_rtne` of bench_quantize.py) under the same launch.
Every launch shape gives the same bits (max is order-free; checked here against the first).
Writes benchmarks/results/sweep_amax.json.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import copy_bandwidth_gbs, environment, graph_ms, save  # noqa: E402
from fp4lab import kernels  # noqa: E402
from fp4lab.kernels import amax  # noqa: E402

BLOCKS, PER_SM, WARPS = (1024, 2048, 4096, 8192), (2, 4, 8, 16), (4, 8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=4096)
    args = parser.parse_args()
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    n, copy = x.numel(), copy_bandwidth_gbs()
    default, rows, want = amax.AMAX_LAUNCH, {}, None
    try:
        for launch in itertools.product(BLOCKS, PER_SM, WARPS):
            amax.AMAX_LAUNCH = launch
            got = amax.finite_amax(x)
            want = got if want is None else want
            assert torch.equal(got, want), (launch, got, want)
            ms = graph_ms(lambda: amax.finite_amax(x))
            quant = graph_ms(lambda: kernels.quantize_nvfp4(x, backend="triton"))
            rows[str(launch)] = {"ms": ms, "read_over_copy": 2 * n / ms / 1e6 / copy,
                                 "quantize_incl_amax_ms": quant,
                                 "quantize_over_copy": n * (2 + 0.5 + 1 / 16) / quant / 1e6 / copy}
            print(f"block {launch[0]:5d}, {launch[1]:2d} a SM, {launch[2]} warps: amax {ms * 1e3:6.1f} us "
                  f"({rows[str(launch)]['read_over_copy']:.2f} of copy), quantize incl. amax {quant * 1e3:6.1f} us "
                  f"({rows[str(launch)]['quantize_over_copy']:.2f}){'  (default)' if launch == default else ''}",
                  flush=True)
    finally:
        amax.AMAX_LAUNCH = default
    best = min(rows, key=lambda k: rows[k]["ms"])
    print(f"copy {copy:.0f} GB/s; fastest {best}: {rows[best]['ms'] * 1e3:.1f} us against the default's "
          f"{rows[str(default)]['ms'] * 1e3:.1f}")
    save("sweep_amax", {**environment(), "shape": [args.rows, args.cols], "copy_gbs": copy,
                        "default": list(default), "launches": rows})


if __name__ == "__main__":
    main()
