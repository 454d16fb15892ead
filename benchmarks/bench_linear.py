"""One linear layer's three GEMMs (fprop, dgrad, wgrad) in NVIDIA's NVFP4 recipe against BF16.

    python benchmarks/bench_linear.py [--compiled]

Both sides are the layer as training runs it, forward and backward through autograd (the input
and weight gradients; bf16 x, W and dy):
    bf16   F.linear: three cuBLAS BF16 GEMMs
    nvfp4  fp4lab.nn.fp4_linear with the nvfp4 preset (arXiv 2509.25149, TE NVFP4BlockScaling):
           fprop  x 1x16 RTNE, W 16x16 RTNE (along K)
           dgrad  dy 1x16 SR, W^T: fprop's 16x16 values reused (the same tiles)
           wgrad  dy^T SR and x^T RTNE, both along M after the 16-point RHT (TE signs)
           each operand quantized straight to exact BF16 block values; x's two copies (fprop's,
           wgrad's) from one read, dy's two (dgrad's, wgrad's) likewise (kernels.quantize_values_pair:
           one amax pass and one quantize pass each), W in one pass plus its amax pass; each GEMM
           kernels.matmul.scaled_mm with alpha in the epilogue
    compiled  (--compiled) the same six fake-quantized operands built from fp4lab.formats and
           torch.compile'd: "what a user would write" (benchmarks/fakequant_baseline.py)
Two times per case: kernel time (the summed durations of the kernels one step launches, from
torch.profiler: device cost without launch gaps; the ratios in latest.json) and eager wall time
(CUDA events around a Python call: adds launch overhead, which dominates at small shapes); and
the wall time of the same forward and backward captured in one CUDA graph and replayed (what a
graphed training step pays: the NVFP4 seeds read from an nn.seeds.SeedTable); and NVFP4 with x and
dy quantized one copy at a time (the pair kernel declined), for the pair's own effect. Writes
benchmarks/results/linear.json and the linear_* keys of latest.json (ratios to BF16 at M=8192,
K=N=4096; 1.0 = BF16's cost).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import bench_ms, captured_ms, environment, kernel_ms, one_copy_at_a_time, save  # noqa: E402
from fp4lab.nn import QuantContext, fp4_linear  # noqa: E402
from fp4lab.nn.seeds import SeedTable  # noqa: E402
from fp4lab.nn.recipe import nvfp4  # noqa: E402

SHAPES = [(8192, 4096, 4096), (4096, 2048, 2048), (8192, 4096, 14336), (16384, 8192, 8192)]


def tensors(m: int, k: int, n: int):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    return x, w, dy


def bf16_step(x, w, dy):
    return torch.autograd.grad(F.linear(x, w), (x, w), dy)


def nvfp4_step(x, w, dy, recipe=nvfp4(), context=QuantContext()):
    return torch.autograd.grad(fp4_linear(x, w, None, recipe, name="bench", context=context), (x, w), dy)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compiled", action="store_true",
                        help="also time the torch.compile'd fake-quant baseline (compiling takes minutes)")
    args = parser.parse_args()
    rows = {}
    for m, k, n in SHAPES:
        x, w, dy = tensors(m, k, n)
        bf16, fp4 = kernel_ms(lambda: bf16_step(x, w, dy)), kernel_ms(lambda: nvfp4_step(x, w, dy))
        bf16_eager, fp4_eager = bench_ms(lambda: bf16_step(x, w, dy)), bench_ms(lambda: nvfp4_step(x, w, dy))
        table = QuantContext(seeds=SeedTable(x.device))  # seeds from device memory, as a captured step reads them
        bf16_graph = captured_ms(lambda: bf16_step(x, w, dy))
        fp4_graph = captured_ms(lambda: nvfp4_step(x, w, dy, context=table))
        with one_copy_at_a_time():  # x and dy quantized one copy at a time, as before the pair kernel
            single = kernel_ms(lambda: nvfp4_step(x, w, dy))
            single_graph = captured_ms(lambda: nvfp4_step(x, w, dy, context=table))
        rows[f"M{m}_K{k}_N{n}"] = {"bf16_ms": bf16, "nvfp4_ms": fp4, "nvfp4_over_bf16": fp4 / bf16,
                                   "nvfp4_single_copy_ms": single, "nvfp4_single_copy_graphed_ms": single_graph,
                                   "pair_over_single_copy": fp4 / single,
                                   "bf16_eager_ms": bf16_eager, "nvfp4_eager_ms": fp4_eager,
                                   "nvfp4_over_bf16_eager": fp4_eager / bf16_eager,
                                   "bf16_graphed_ms": bf16_graph, "nvfp4_graphed_ms": fp4_graph,
                                   "nvfp4_over_bf16_graphed": fp4_graph / bf16_graph}
        print(f"M={m} K={k} N={n}: kernel time bf16 {bf16:.3f} ms, nvfp4 {fp4:.3f} ms, ratio {fp4 / bf16:.2f}; "
              f"eager {bf16_eager:.3f} / {fp4_eager:.3f} ms, ratio {fp4_eager / bf16_eager:.2f}; "
              f"graphed {bf16_graph:.3f} / {fp4_graph:.3f} ms, ratio {fp4_graph / bf16_graph:.2f}; one copy at a "
              f"time {single:.3f} ms kernel, {single_graph:.3f} ms graphed (pair {fp4 / single:.2f}x)", flush=True)
    payload = {**environment(), "shapes": rows}
    big, small = rows["M8192_K4096_N4096"], rows["M4096_K2048_N2048"]
    save("linear", payload, {"linear_nvfp4_over_bf16": big["nvfp4_over_bf16"],
                             "linear_nvfp4_over_bf16_graphed": big["nvfp4_over_bf16_graphed"],
                             "linear_small_nvfp4_over_bf16_graphed": small["nvfp4_over_bf16_graphed"],
                             "linear_pair_over_single_copy": big["pair_over_single_copy"]})
    if args.compiled:
        from benchmarks.fakequant_baseline import make_fakequant_step
        m, k, n = SHAPES[0]
        x, w, dy = (t.detach() for t in tensors(m, k, n))
        start = time.perf_counter()
        compiled = make_fakequant_step()
        compiled(x, w, dy)
        torch.cuda.synchronize()
        payload["compiled_fakequant_compile_s"] = time.perf_counter() - start
        ratio = kernel_ms(lambda: compiled(x, w, dy)) / rows["M8192_K4096_N4096"]["bf16_ms"]
        payload["compiled_fakequant_eager_over_bf16"] = (bench_ms(lambda: compiled(x, w, dy))
                                                         / rows["M8192_K4096_N4096"]["bf16_eager_ms"])
        payload["compiled_fakequant_over_bf16"] = ratio
        save("linear", payload, {"linear_compiled_fakequant_over_bf16": ratio})
        print(f"compiled fake-quant step over bf16: {ratio:.2f} (compiling took "
              f"{payload['compiled_fakequant_compile_s']:.0f} s)")
    print(f"{payload['device']}  torch {payload['torch']}  triton {payload['triton']}")


if __name__ == "__main__":
    main()
