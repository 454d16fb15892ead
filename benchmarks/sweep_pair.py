"""Tiles a program of the pair kernel, per pass, at the shapes a d12 training step quantizes.

    python benchmarks/sweep_pair.py

A linear's two copies of x (fprop's rows, wgrad's columns with random-sign RHT) and of dy (both
with SR), both passes (amax, copies), as kernels.quantize_values_pair runs them, for each
(amax pass, copies' pass) choice of kernels.quantize.PAIR_ITERS: CUDA-graph time per call, and
the sum over one d12 step's pair calls (16 x 1024 tokens, 12 blocks: x of width 768 three times
a block and 3072 once; dy of width 2304, 768 twice, 3072). Every choice's bytes are checked
against (1, 1)'s. Writes benchmarks/results/sweep_pair.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, graph_ms, save  # noqa: E402
from fp4lab import kernels  # noqa: E402
from fp4lab.kernels import quantize  # noqa: E402

CHOICES = [(1, 1), (8, 1), (8, 2), (8, 4), (4, 4), (8, 8)]
TOKENS = 16 * 1024
# (tensor, width) -> pair calls of that shape in one d12 step
D12_CALLS = {("x", 768): 36, ("x", 3072): 12, ("dy", 2304): 12, ("dy", 768): 24, ("dy", 3072): 12}
SETTINGS = {"x": ({}, dict(hadamard="random", hadamard_seed=2)),
            "dy": (dict(rounding="stochastic", seed=1), dict(rounding="stochastic", seed=3, hadamard="random",
                                                             hadamard_seed=2))}


def pair(x: torch.Tensor, tensor: str):
    rows, columns = SETTINGS[tensor]
    return kernels.quantize_values_pair(x, "nvfp4", rows=rows, columns=columns, columns_len=x.shape[0],
                                        backend="triton")


def with_iters(iters: tuple[int, int], fn):
    saved = quantize.PAIR_ITERS
    quantize.PAIR_ITERS = iters
    try:
        return fn()
    finally:
        quantize.PAIR_ITERS = saved


def main() -> None:
    shapes = sorted({(TOKENS, w) for _, w in D12_CALLS} | {(8192, 4096)})
    inputs = {s: torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes}
    results, step_ms = {}, {}
    for iters in CHOICES:
        step = 0.0
        for shape, x in inputs.items():
            for tensor in SETTINGS:
                got = with_iters(iters, lambda: pair(x, tensor))
                want = with_iters((1, 1), lambda: pair(x, tensor))
                same = all(torch.equal(g.values, w.values) and torch.equal(g.tensor_scale, w.tensor_scale)
                           for g, w in zip(got, want))
                ms = with_iters(iters, lambda: graph_ms(lambda: pair(x, tensor)))
                key = f"{tensor}_{shape[0]}x{shape[1]}_iters{iters[0]}x{iters[1]}"
                results[key] = {"ms": ms, "same_bytes_as_1x1": same}
                step += ms * D12_CALLS.get((tensor, shape[1]), 0) if shape[0] == TOKENS else 0.0
                print(f"{key:36s} {ms * 1e3:8.1f} us  same bytes: {same}", flush=True)
        step_ms[f"{iters[0]}x{iters[1]}"] = step
        print(f"iters {iters}: a d12 step's pair calls {step:.2f} ms", flush=True)
    best = min(step_ms, key=step_ms.get)
    print(f"best {best}: {step_ms[best]:.2f} ms against {step_ms['1x1']:.2f} ms at 1x1")
    save("sweep_pair", {**environment(), "cases": results, "d12_step_pair_ms": step_ms})


if __name__ == "__main__":
    main()
