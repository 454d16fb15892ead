"""Emulated FP4 GEMM throughput against cuBLAS BF16, measured side by side on one GPU.

    python benchmarks/bench_gemm.py

For each shape (M, N, K): cuBLAS BF16 (torch.matmul), fp4lab's fused kernel (packed codes and
scales decoded in registers, kernels/gemm.py), and the two-stage path (Triton decodes both
operands to exact BF16, cuBLAS multiplies with FP32 output, alpha after). TFLOP/s count 2 M N K. A tile sweep at 8192^3 comes first, and a
correctness check against formats.scaled_mm's summation bound at 2048^3. Writes
benchmarks/results/gemm.json and the gemm_* keys of latest.json (gemm_fp4_over_bf16: the faster method, what fp4_mm runs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, graph_ms, save  # noqa: E402
from fp4lab import formats, kernels  # noqa: E402
from fp4lab.kernels.gemm import _fp4_mm_kernel, fp4_mm  # noqa: E402

SHAPES = [(8192, 8192, 8192), (8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336), (4096, 4096, 4096)]
TILES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3),
         (128, 256, 128, 8, 2), (64, 256, 64, 4, 4)]


def operands(m: int, n: int, k: int):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qa = kernels.quantize_nvfp4(x)
    qb = kernels.quantize_nvfp4(w, block=(16, 16))
    return x, w, qa, qb


def sweep(qa, qb, m: int, n: int, k: int) -> dict:
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    results = {}
    for bm, bn, bk, warps, stages in TILES:
        def run():
            _fp4_mm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
                qa.codes, qa.scales.view(torch.uint8), qb.codes, qb.scales.view(torch.uint8), qa.tensor_scale,
                qb.tensor_scale, out, m, n, k, BLOCK=16, NVFP4=True, BM=bm, BN=bn, BK=bk, GROUP_M=8,
                DOT_F32=False, num_warps=warps, num_stages=stages)
        try:
            ms = graph_ms(run)
        except Exception as exc:  # e.g. out of shared memory for this tile
            print(f"tile {bm}x{bn}x{bk} w{warps} s{stages}: {type(exc).__name__}")
            continue
        results[f"{bm}x{bn}x{bk}_w{warps}_s{stages}"] = 2 * m * n * k / ms / 1e9
        print(f"tile {bm}x{bn}x{bk} w{warps} s{stages}: {results[f'{bm}x{bn}x{bk}_w{warps}_s{stages}']:.0f} TFLOP/s")
    return results


def check(m: int = 2048) -> float:
    """Largest |fused - scaled_mm| over the summation bound, at m^3 (must be <= 1)."""
    _, _, qa, qb = operands(m, m, m)
    ref = formats.scaled_mm(qa, qb).double()
    a, b = formats.dequantize(qa).double().abs(), formats.dequantize(qb).double().abs()
    bound = 2 * m * 2**-24 * (a @ b.T) + 1e-30
    return max(float(((fp4_mm(qa, qb, method=method).double() - ref).abs() / bound).max())
               for method in ("fused", "two_stage"))


def main() -> None:
    worst = check()
    print(f"correctness at 2048^3: max |fused - scaled_mm| / bound = {worst:.3f}")
    rows = {}
    tiles = sweep(*operands(8192, 8192, 8192)[2:], 8192, 8192, 8192)
    for m, n, k in SHAPES:
        x, w, qa, qb = operands(m, n, k)
        flops = 2 * m * n * k
        bf16 = graph_ms(lambda: x @ w.T)
        fused = graph_ms(lambda: fp4_mm(qa, qb, out_dtype=torch.bfloat16, method="fused"))
        two_stage = graph_ms(lambda: fp4_mm(qa, qb, out_dtype=torch.bfloat16, method="two_stage"))
        rows[f"{m}x{n}x{k}"] = {"bf16_tflops": flops / bf16 / 1e9, "fp4_fused_tflops": flops / fused / 1e9,
                                "fp4_two_stage_tflops": flops / two_stage / 1e9,
                                "fused_over_bf16": bf16 / fused, "two_stage_over_bf16": bf16 / two_stage}
    payload = {**environment(), "check_max_over_bound": worst, "tile_sweep_8192_tflops": tiles, "shapes": rows}
    print(f"{payload['device']}  torch {payload['torch']}  triton {payload['triton']}")
    print(f"{'M x N x K':20s} {'bf16':>7s} {'fused':>7s} {'2-stage':>8s} {'fused/bf16':>10s} {'2-stage/bf16':>12s}")
    for shape, r in rows.items():
        print(f"{shape:20s} {r['bf16_tflops']:7.0f} {r['fp4_fused_tflops']:7.0f} {r['fp4_two_stage_tflops']:8.0f} "
              f"{r['fused_over_bf16']:10.2f} {r['two_stage_over_bf16']:12.2f}")
    big = rows["8192x8192x8192"]
    print("saved", save("gemm", payload, {"gemm_fp4_over_bf16": max(big["fused_over_bf16"], big["two_stage_over_bf16"]),
                                          "gemm_fp4_fused_over_bf16": big["fused_over_bf16"],
                                          "gemm_fp4_two_stage_over_bf16": big["two_stage_over_bf16"]}))


if __name__ == "__main__":
    main()
