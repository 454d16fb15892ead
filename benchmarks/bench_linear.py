"""One linear layer's three GEMMs (fprop, dgrad, wgrad) in NVIDIA's NVFP4 recipe against BF16.

    python benchmarks/bench_linear.py

The NVFP4 step (arXiv 2509.25149, TE NVFP4BlockScaling defaults), every quantize from fp4lab.kernels:
    fprop  y  = x @ W^T      x: 1x16 RTNE along K;  W: 16x16 RTNE along K
    dgrad  dx = dy @ W       dy: 1x16 SR along N;   W: 16x16 RTNE along N (the columnwise copy)
    wgrad  dW = dy^T @ x     dy, x: along M after the 16-point RHT (TE signs); dy SR, x RTNE
GEMMs run through kernels.gemm.fp4_mm (method auto). Baselines timed in the same run: three
cuBLAS BF16 GEMMs, and the same step written with a torch.compile'd fake quantization built from
fp4lab.formats ("what a user would write", with --compiled: compiling it takes minutes). Times
are CUDA-graph replays. Writes
benchmarks/results/linear.json and the linear_* keys of latest.json (ratios to BF16 at
M=8192, K=N=4096; lower is better, 1.0 = BF16's cost).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import bench_ms, environment, graph_ms, save  # noqa: E402
from fp4lab import formats, kernels  # noqa: E402
from fp4lab.kernels.gemm import fp4_mm  # noqa: E402

SHAPES = [(8192, 4096, 4096), (4096, 2048, 2048), (8192, 4096, 14336), (16384, 8192, 8192)]


def nvfp4_step(x, w, dy, seed: int = 1):
    q = kernels.quantize_nvfp4
    y = fp4_mm(q(x), q(w, block=(16, 16)), out_dtype=torch.bfloat16)
    dx = fp4_mm(q(dy, rounding="stochastic", seed=seed), q(w, block=(16, 16), axis=0), out_dtype=torch.bfloat16)
    dw = fp4_mm(q(dy, axis=0, hadamard="te", rounding="stochastic", seed=seed + 1),
                q(x, axis=0, hadamard="te"), out_dtype=torch.bfloat16)
    return y, dx, dw


def bf16_step(x, w, dy):
    return x @ w.T, dy @ w, dy.T @ x


def fakequant_step(x, w, dy):
    def fq(t, **kw):
        return formats.dequantize(formats.quantize_nvfp4(t, **kw), torch.bfloat16)
    y = fq(x) @ fq(w, block=(16, 16)).T
    dx = fq(dy, rounding="stochastic", seed=1) @ fq(w, block=(16, 16), axis=0)
    dw = fq(dy, axis=0, hadamard="te", rounding="stochastic", seed=2).T @ fq(x, axis=0, hadamard="te")
    return y, dx, dw


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compiled", action="store_true",
                        help="also time the torch.compile'd fake-quant baseline (compiling takes minutes)")
    args = parser.parse_args()
    rows = {}
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        bf16 = graph_ms(lambda: bf16_step(x, w, dy))
        fp4 = graph_ms(lambda: nvfp4_step(x, w, dy))
        rows[f"M{m}_K{k}_N{n}"] = {"bf16_ms": bf16, "nvfp4_ms": fp4, "nvfp4_over_bf16": fp4 / bf16}
        print(f"M={m} K={k} N={n}: bf16 {bf16:.3f} ms, nvfp4 {fp4:.3f} ms, ratio {fp4 / bf16:.2f}", flush=True)
    payload = {**environment(), "shapes": rows}
    save("linear", payload, {"linear_nvfp4_over_bf16": rows["M8192_K4096_N4096"]["nvfp4_over_bf16"]})
    if args.compiled:
        compiled = torch.compile(fakequant_step)
        m, k, n = SHAPES[0]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        compiled(x, w, dy)
        ratio = bench_ms(lambda: compiled(x, w, dy)) / rows["M8192_K4096_N4096"]["bf16_ms"]
        payload["compiled_fakequant_over_bf16"] = ratio
        save("linear", payload, {"linear_compiled_fakequant_over_bf16": ratio})
        print(f"compiled fake-quant step over bf16: {ratio:.2f}")
    print(f"{payload['device']}  torch {payload['torch']}  triton {payload['triton']}")


if __name__ == "__main__":
    main()
