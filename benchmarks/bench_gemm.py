"""Emulated FP4 GEMM throughput against cuBLAS BF16, measured side by side on one GPU.

    python benchmarks/bench_gemm.py

For each shape (M, N, K), TFLOP/s counting 2 M N K: cuBLAS BF16 (torch.matmul) and fp4_mm's
methods (kernels/gemm.py) from packed NVFP4 operands (activations 1x16, weights 16x16):
    decoded    Triton decodes both operands to exact BF16 block values, kernels.matmul.scaled_mm
               multiplies with alpha and the bf16 cast in its epilogue (what fp4_mm runs on CUDA)
    two_stage  the same decode, cuBLAS with FP32 output, then alpha and the cast as two passes
    fused      decode in the GEMM's main loop (8192^3 only: it is far behind)
    values     scaled_mm alone on already-decoded operands (what a layer that quantizes straight
               to BlockValues pays for its GEMM)
First a tile sweep of scaled_mm at 8192^3 (TMA and pointer loaders) and a correctness check against formats.scaled_mm's
summation bound at 2048^3; last, the grouped (MoE) GEMM: one launch for E experts with uneven
rows against a loop of per-expert fp4_mm calls and against BF16 (a cuBLAS loop, and
torch._grouped_mm where this torch has it), and grouped_scaled_mm alone on decoded operands; then
moe64's expert wgrad (each expert's tokens contracted): contraction_grouped_mm in one launch
against the per-expert scaled_mm calls and against BF16. These
are eager CUDA-event times (the grouped launch copies its tile list to the device), so at this
size they include Python launch overhead: ~30 launches for fp4_grouped. Writes benchmarks/results/gemm.json and the gemm_*
keys of latest.json (gemm_fp4_over_bf16: fp4_mm's default method at 8192^3).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import bench_ms, environment, graph_ms, save  # noqa: E402
from fp4lab import formats, kernels  # noqa: E402
from fp4lab.kernels.gemm import fp4_mm, grouped_fp4_mm  # noqa: E402
from fp4lab.kernels import matmul  # noqa: E402
from fp4lab.kernels.matmul import contraction_grouped_mm, grouped_scaled_mm, scaled_mm  # noqa: E402

SHAPES = [(8192, 8192, 8192), (8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336), (4096, 4096, 4096)]
TILES = [(256, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 4), (128, 256, 64, 8, 4),
         (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (256, 128, 128, 8, 2)]
GROUPED = dict(experts=8, rows=16384, k=2048, n=2816)  # MoE expert GEMM: 8 experts, uneven token counts
WGRAD = dict(experts=64, rows=49152, k=512, n=256)  # moe64's expert wgrad: dW_e [N, K] over each expert's tokens


def operands(m: int, n: int, k: int):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return x, w, kernels.quantize_nvfp4(x), kernels.quantize_nvfp4(w, block=(16, 16))


def sweep(m: int, n: int, k: int) -> dict:
    """scaled_mm at m x n x k for each tile and both tile loaders (TMA descriptors, pointers); also
    with B transposed in memory (dgrad's W^T view)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b_t = b.T.contiguous().T
    alpha = torch.ones((), device="cuda")
    saved = (matmul._BM, matmul._BN, matmul._BK, matmul._WARPS, matmul._STAGES, matmul.USE_TMA, matmul.CUBLASLT)
    results = {"cublaslt": 2 * m * n * k / graph_ms(lambda: scaled_mm(a, b, alpha)) / 1e9}  # matmul's default on CUDA
    print(f"cuBLASLt: {results['cublaslt']:.0f} TFLOP/s", flush=True)
    matmul.CUBLASLT = False  # (the Triton tiles)
    for tma in (True, False):
        for tile in TILES:
            matmul._BM, matmul._BN, matmul._BK, matmul._WARPS, matmul._STAGES = tile
            matmul.USE_TMA = tma
            name = ("tma_" if tma else "ptr_") + "{}x{}x{}_w{}_s{}".format(*tile)
            try:
                results[name] = 2 * m * n * k / graph_ms(lambda: scaled_mm(a, b, alpha)) / 1e9
                if tile == TILES[0]:
                    results[name + "_bT"] = 2 * m * n * k / graph_ms(lambda: scaled_mm(a, b_t, alpha)) / 1e9
            except Exception as exc:  # e.g. out of shared memory for this tile
                print(f"tile {name}: {type(exc).__name__}")
                continue
            print(f"tile {name}: {results[name]:.0f} TFLOP/s", flush=True)
    (matmul._BM, matmul._BN, matmul._BK, matmul._WARPS, matmul._STAGES, matmul.USE_TMA, matmul.CUBLASLT) = saved
    return results


def check(m: int = 2048) -> float:
    """Largest |fp4_mm - scaled_mm| over the summation bound at m^3, every method (must be <= 1)."""
    _, _, qa, qb = operands(m, m, m)
    ref = formats.scaled_mm(qa, qb).double()
    a, b = formats.dequantize(qa).double().abs(), formats.dequantize(qb).double().abs()
    bound = 2 * m * 2**-24 * (a @ b.T) + 1e-30
    return max(float(((fp4_mm(qa, qb, method=method).double() - ref).abs() / bound).max())
               for method in ("fused", "two_stage", "decoded"))


def uneven(experts: int, rows: int, seed: int) -> list[int]:
    """``rows`` split over the experts unevenly (as a router splits tokens), every expert some."""
    weights = torch.rand(experts, generator=torch.Generator().manual_seed(seed)) + 0.3
    sizes = (weights / weights.sum() * rows).long()
    sizes[-1] += rows - sizes.sum()
    return sizes.tolist()


def grouped(experts: int, rows: int, k: int, n: int) -> dict:
    sizes = uneven(experts, rows, 0)
    xs = [torch.randn(s, k, device="cuda", dtype=torch.bfloat16) for s in sizes]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in sizes]
    qa, qb = [kernels.quantize_nvfp4(x) for x in xs], [kernels.quantize_nvfp4(w, block=(16, 16)) for w in ws]
    x_all, w_all = torch.cat(xs), torch.stack(ws)
    flops = 2 * rows * n * k
    times = {"bf16_loop": bench_ms(lambda: [x @ w.T for x, w in zip(xs, ws)]),
             "fp4_loop": bench_ms(lambda: [fp4_mm(a, b, out_dtype=torch.bfloat16) for a, b in zip(qa, qb)]),
             "fp4_grouped": bench_ms(lambda: grouped_fp4_mm(qa, qb))}
    # the grouped GEMM alone, on operands already decoded (as a layer quantizing to values has them)
    a_vals = torch.cat([kernels.quantize_values(x).matrix for x in xs])
    b_vals = torch.stack([kernels.quantize_values(w, block=(16, 16)).matrix for w in ws])
    alpha = torch.ones(experts, device="cuda")
    times["values_grouped"] = bench_ms(lambda: grouped_scaled_mm(a_vals, b_vals, sizes, alpha))
    if hasattr(torch, "_grouped_mm"):
        offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        times["bf16_grouped_mm"] = bench_ms(lambda: torch._grouped_mm(x_all, w_all.transpose(1, 2), offs=offs))
    best_bf16 = min(v for key, v in times.items() if key.startswith("bf16"))
    result = {"sizes": sizes, "k": k, "n": n, **{f"{key}_tflops": flops / v / 1e9 for key, v in times.items()},
              "grouped_over_fp4_loop": times["fp4_loop"] / times["fp4_grouped"],
              "grouped_over_best_bf16": best_bf16 / times["fp4_grouped"],
              "values_grouped_over_best_bf16": best_bf16 / times["values_grouped"]}
    for key, v in times.items():
        print(f"grouped {experts} experts, {rows} rows, K={k} N={n}: {key:16s} {v:.3f} ms "
              f"{flops / v / 1e9:5.0f} TFLOP/s")
    return result


def grouped_wgrad(experts: int, rows: int, k: int, n: int) -> dict:
    """Every expert's dW = dy_e^T x_e, each over its own tokens (padded to 32 per expert, as the FP4
    path pads them): one contraction_grouped_mm launch against the per-expert scaled_mm calls it
    replaced, and against BF16 (torch._grouped_mm's 2d x 2d form, and a cuBLAS loop)."""
    widths = [s + (-s % 32) for s in uneven(experts, rows, 1)]
    dy_vals = torch.randn(n, sum(widths), device="cuda", dtype=torch.bfloat16)  # values as the quantize writes them
    x_vals = torch.randn(k, sum(widths), device="cuda", dtype=torch.bfloat16)
    alpha = torch.ones(experts, device="cuda")
    cols = [slice(a, a + w) for a, w in zip([0, *torch.tensor(widths).cumsum(0).tolist()], widths)]
    dy_bf16, x_bf16 = dy_vals.T.contiguous(), x_vals.T.contiguous()  # [S, N], [S, K] as BF16 wgrad has them
    flops = 2 * sum(widths) * n * k
    times = {"values_loop": bench_ms(lambda: [scaled_mm(dy_vals[:, c], x_vals[:, c], alpha[0]) for c in cols]),
             "values_grouped": bench_ms(lambda: contraction_grouped_mm(dy_vals, x_vals, widths, alpha)),
             "bf16_loop": bench_ms(lambda: [dy_bf16[c].T @ x_bf16[c] for c in cols])}
    if hasattr(torch, "_grouped_mm"):
        offs = torch.tensor(widths, device="cuda").cumsum(0).to(torch.int32)
        times["bf16_grouped_mm"] = bench_ms(lambda: torch._grouped_mm(dy_bf16.T, x_bf16, offs=offs))
    best_bf16 = min(v for key, v in times.items() if key.startswith("bf16"))
    for key, v in times.items():
        print(f"wgrad {experts} experts, {rows} rows, N={n} K={k}: {key:16s} {v:.3f} ms {flops / v / 1e9:5.0f} TFLOP/s")
    return {"widths": widths, "k": k, "n": n, **{f"{key}_ms": v for key, v in times.items()},
            "grouped_over_loop": times["values_loop"] / times["values_grouped"],
            "grouped_over_best_bf16": best_bf16 / times["values_grouped"]}


def main() -> None:
    worst = check()
    print(f"correctness at 2048^3: max |fp4_mm - scaled_mm| / bound = {worst:.3f}", flush=True)
    tiles = sweep(8192, 8192, 8192)
    rows = {}
    for m, n, k in SHAPES:
        x, w, qa, qb = operands(m, n, k)
        flops = 2 * m * n * k
        a_vals = kernels.quantize_values(x)
        b_vals = kernels.quantize_values(w, block=(16, 16))
        times = {"bf16": graph_ms(lambda: x @ w.T),
                 "decoded": graph_ms(lambda: fp4_mm(qa, qb, out_dtype=torch.bfloat16, method="decoded")),
                 "two_stage": graph_ms(lambda: fp4_mm(qa, qb, out_dtype=torch.bfloat16, method="two_stage")),
                 "values": graph_ms(lambda: kernels.values_mm(a_vals, b_vals, out_dtype=torch.bfloat16))}
        if (m, n, k) == SHAPES[0]:
            times["fused"] = graph_ms(lambda: fp4_mm(qa, qb, out_dtype=torch.bfloat16, method="fused"))
        rows[f"{m}x{n}x{k}"] = {**{f"{key}_tflops": flops / v / 1e9 for key, v in times.items()},
                                **{f"{key}_over_bf16": times["bf16"] / v for key, v in times.items() if key != "bf16"}}
    group = grouped(**GROUPED)
    wgrad = grouped_wgrad(**WGRAD)
    payload = {**environment(), "check_max_over_bound": worst, "tile_sweep_8192_tflops": tiles, "shapes": rows,
               "grouped": group, "grouped_wgrad": wgrad}
    print(f"{payload['device']}  torch {payload['torch']}  triton {payload['triton']}")
    print(f"{'M x N x K':18s} {'bf16':>6s} {'decoded':>8s} {'2-stage':>8s} {'values':>7s}   (TFLOP/s; ratios to bf16)")
    for shape, r in rows.items():
        print(f"{shape:18s} {r['bf16_tflops']:6.0f} {r['decoded_tflops']:8.0f} {r['two_stage_tflops']:8.0f} "
              f"{r['values_tflops']:7.0f}   {r['decoded_over_bf16']:.2f} {r['two_stage_over_bf16']:.2f} "
              f"{r['values_over_bf16']:.2f}")
    big = rows["8192x8192x8192"]
    print("saved", save("gemm", payload, {"gemm_fp4_over_bf16": big["decoded_over_bf16"],
                                          "gemm_fp4_two_stage_over_bf16": big["two_stage_over_bf16"],
                                          "gemm_fp4_fused_over_bf16": big["fused_over_bf16"],
                                          "gemm_values_over_bf16": big["values_over_bf16"],
                                          "gemm_grouped_over_fp4_loop": group["grouped_over_fp4_loop"],
                                          "gemm_grouped_over_bf16": group["grouped_over_best_bf16"],
                                          "gemm_values_grouped_over_bf16": group["values_grouped_over_best_bf16"],
                                          "gemm_wgrad_grouped_over_loop": wgrad["grouped_over_loop"],
                                          "gemm_wgrad_grouped_over_bf16": wgrad["grouped_over_best_bf16"]}))


if __name__ == "__main__":
    main()
