"""Tile-shape sweep for the quantize kernel: time, registers and spills per configuration.

    python benchmarks/sweep_quantize.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import bench_ms, copy_bandwidth_gbs  # noqa: E402
from fp4lab.kernels.amax import finite_amax  # noqa: E402
from fp4lab.kernels.quantize import _fp4_quantize_kernel  # noqa: E402


def main() -> None:
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    rows, lp = x.shape
    copy = copy_bandwidth_gbs()
    amax, s_dec = finite_amax(x), torch.empty((), device="cuda")
    print(f"copy {copy:.0f} GB/s")
    for rule, block, sr in [(0, 16, False), (0, 16, True), (2, 32, False)]:
        for br, bc, warps in [(32, 128, 4), (16, 256, 4), (8, 512, 4), (16, 128, 4), (16, 128, 2),
                              (32, 256, 8), (64, 256, 8), (32, 512, 8)]:
            codes = torch.empty(rows, lp // 2, dtype=torch.uint8, device="cuda")
            scales = torch.empty(rows, lp // block, dtype=torch.uint8, device="cuda")
            grid = (triton.cdiv(rows, br), triton.cdiv(lp, bc))

            def run():
                return _fp4_quantize_kernel[grid](x.view(torch.int16), codes, scales, amax, s_dec, 1, rows, lp, rows,
                                                  lp, lp, 1, SCALE_RULE=rule, BLOCK=block, TILE_ROWS=1,
                                                  STOCHASTIC=sr, BF16_BITS=True, BR=br, BC=bc, num_warps=warps)
            k = run()
            ms = bench_ms(run)
            gbs = x.numel() * (2.5 + 1 / block) / ms / 1e6
            print(f"rule {rule} sr {sr:d} BR {br:3d} BC {bc:3d} warps {warps}: {ms:.3f} ms {gbs:6.0f} GB/s "
                  f"{gbs / copy:.2f}  regs {k.n_regs} spills {k.n_spills}")


if __name__ == "__main__":
    main()
