"""The pair kernel's tiles a program and registers a thread, per pass, at a d12 step's shapes.

    python benchmarks/sweep_pair.py

A linear's two copies of x (fprop's rows, wgrad's columns with TE-sign RHT) and of dy (both
with SR), both passes (amax, copies), as kernels.quantize_values_pair runs them in NVIDIA's
recipe, for each (amax pass, copies' pass) choice of kernels.quantize.PAIR_ITERS and PAIR_MAXNREG
(a register cap, None: the compiler's choice; a lower cap fits more programs on an SM and may
spill): CUDA-graph time per call, and the sum over one d12 step's pair calls (16 x 1024 tokens;
the `nvfp4` preset keeps the last 2 of 12 blocks in BF16, and a block's SwiGLU MLP is 768 -> 2 x
2048 -> 768: counted from the model, see D12_CALLS). A choice's tiles a program are at most its
PAIR_ITERS: fewer where the grid would fall under PAIR_PROGRAMS (4 at width 768). Every choice's
bytes are checked against those of the first.
Writes benchmarks/results/sweep_pair.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, graph_ms, save  # noqa: E402
from fp4lab import kernels  # noqa: E402
from fp4lab.kernels import quantize  # noqa: E402

# (PAIR_ITERS, PAIR_MAXNREG)
CHOICES = [((1, 1), (None, None)), ((8, 1), (None, None)), ((8, 2), (None, None)), ((8, 1), (None, 48))]
TOKENS = 16 * 1024
# (tensor, width) -> pair calls of that shape in one d12 step under the nvfp4 preset (10 FP4 blocks:
# x of qkv, proj, gate, up at 768 and of down at 2048; dy of qkv at 2304, proj and down at 768,
# gate and up at 2048), counted by wrapping quantize_values_pair over a CPU step
D12_CALLS = {("x", 768): 40, ("x", 2048): 10, ("dy", 768): 20, ("dy", 2048): 20, ("dy", 2304): 10}
SETTINGS = {"x": ({}, dict(hadamard="te")),
            "dy": (dict(rounding="stochastic", seed=1), dict(rounding="stochastic", seed=3, hadamard="te"))}


def pair(x: torch.Tensor, tensor: str):
    rows, columns = SETTINGS[tensor]
    return kernels.quantize_values_pair(x, "nvfp4", rows=rows, columns=columns, columns_len=x.shape[0],
                                        backend="triton")


def with_choice(choice: tuple, fn):
    """fn() with kernels.quantize's (PAIR_ITERS, PAIR_MAXNREG) set to ``choice``, restored after."""
    saved = quantize.PAIR_ITERS, quantize.PAIR_MAXNREG
    quantize.PAIR_ITERS, quantize.PAIR_MAXNREG = choice
    try:
        return fn()
    finally:
        quantize.PAIR_ITERS, quantize.PAIR_MAXNREG = saved


def name(choice: tuple) -> str:
    (amax, copies), (r_amax, r_copies) = choice
    return f"iters{amax}x{copies}" + ("" if choice[1] == (None, None) else f"_regs{r_amax or '-'}x{r_copies or '-'}")


def time_choice(choice: tuple, inputs: dict, wants: dict, results: dict) -> float | None:
    """Times every shape and tensor under ``choice`` into ``results``, its bytes checked against
    ``wants`` (the first choice's pairs); -> the d12 step's pair time in ms, or None where the
    choice does not compile (a register cap the compiler refuses, say)."""
    step = 0.0
    for shape, x in inputs.items():
        for tensor in SETTINGS:
            try:
                got = with_choice(choice, lambda: pair(x, tensor))
                ms = with_choice(choice, lambda: graph_ms(lambda: pair(x, tensor)))
            except Exception as exc:  # noqa: BLE001 (reported, and the sweep goes on)
                print(f"{name(choice)}: {type(exc).__name__}: {exc}", flush=True)
                return None
            want = wants[shape, tensor]
            same = all(torch.equal(g.values, w.values) and torch.equal(g.tensor_scale, w.tensor_scale)
                       for g, w in zip(got, want))
            key = f"{tensor}_{shape[0]}x{shape[1]}_{name(choice)}"
            results[key] = {"ms": ms, "same_bytes_as_first_choice": same}
            step += ms * D12_CALLS.get((tensor, shape[1]), 0) if shape[0] == TOKENS else 0.0
            print(f"{key:44s} {ms * 1e3:8.1f} us  same bytes: {same}", flush=True)
    return step


def main() -> None:
    shapes = sorted({(TOKENS, w) for _, w in D12_CALLS} | {(8192, 4096)})
    inputs = {s: torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes}
    wants = {(shape, tensor): with_choice(CHOICES[0], lambda: pair(x, tensor))
             for shape, x in inputs.items() for tensor in SETTINGS}
    results, step_ms = {}, {}
    for choice in CHOICES:
        step = time_choice(choice, inputs, wants, results)
        if step is not None:
            step_ms[name(choice)] = step
            print(f"{name(choice)}: a d12 step's pair calls {step:.2f} ms", flush=True)
    first = name(CHOICES[0])
    best = min(step_ms, key=step_ms.get)
    print(f"best {best}: {step_ms[best]:.2f} ms against {step_ms[first]:.2f} ms at {first}")
    save("sweep_pair", {**environment(), "cases": results, "d12_step_pair_ms": step_ms})


if __name__ == "__main__":
    main()
