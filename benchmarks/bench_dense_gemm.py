"""The dense scaled GEMM at a GPT block's shapes: cuBLASLt (matmul's default on CUDA) against the
Triton kernel and torch.mm, side by side on one GPU.

    python benchmarks/bench_dense_gemm.py [--model d12 --tokens 16384]

For each of one block's GEMM shapes (five linears x fprop, dgrad, wgrad: sweep_gemm.block_gemms):
device time from CUDA-graph replays of matmul.scaled_mm with a tensor-scale pair on cuBLASLt
(kernels.blas) and on the Triton kernels (matmul.CUBLASLT = False), and of torch.mm (cuBLAS BF16,
no scale); the share of output bits the two scaled paths agree on (they differ in fp32 summation
order only), and each one's largest error against float64 over the output's largest magnitude.
Then host time a call at a small shape (512^3, host-bound), eager, through each path (the op a
compiled step calls included). Writes
benchmarks/results/dense_gemm.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, graph_ms, host_us, save  # noqa: E402
from benchmarks.sweep_gemm import block_gemms  # noqa: E402
from fp4lab.kernels import matmul  # noqa: E402


def _scaled(a: torch.Tensor, b: torch.Tensor, pair: tuple, lt: bool):
    """A call of scaled_mm on cuBLASLt (``lt``) or on the Triton kernels."""
    def call() -> torch.Tensor:
        matmul.CUBLASLT = lt
        return matmul.scaled_mm(a, b, pair)
    return call


def _host_costs(a: torch.Tensor, b: torch.Tensor, pair: tuple, rounds: int = 7, calls: int = 200) -> dict:
    """Host microseconds a call (the median of interleaved rounds: the lent hosts drift): scaled_mm
    on cuBLASLt with the scale pair and with one alpha, on the Triton kernels, torch.mm; the op a
    compiled step calls (fp4lab::lt_scaled_mm: two scales, one), its Python body alone, a Library
    op that does nothing (the dispatch), and alpha's product."""
    from fp4lab.kernels import blas
    if not hasattr(torch.ops.fp4lab, "bench_noop"):
        noop = torch.library.Library("fp4lab", "FRAGMENT")
        noop.define("bench_noop(Tensor a, Tensor b, Tensor[] scales, bool bf16_out) -> Tensor")
        noop.impl("bench_noop", lambda a, b, scales, bf16_out: a, "CUDA")
        _host_costs.library = noop  # (kept: the op lives as long as its Library)
    alpha = pair[0] * pair[1]

    def on_lt(fn):  # (the op's body takes cuBLASLt only while matmul.CUBLASLT is on)
        def call():
            matmul.CUBLASLT = True
            return fn()
        return call
    calls_of = {"cublaslt": _scaled(a, b, pair, True), "cublaslt_one_alpha": _scaled(a, b, alpha, True),
                "triton": _scaled(a, b, pair, False), "torch_mm": lambda: torch.mm(a, b.T),
                "lt_op": on_lt(lambda: torch.ops.fp4lab.lt_scaled_mm.default(a, b, list(pair), True)),
                "lt_op_one_scale": on_lt(lambda: torch.ops.fp4lab.lt_scaled_mm.default(a, b, [alpha], True)),
                "lt_op_body_one_scale": on_lt(lambda: blas._lt_scaled_mm(a, b, [alpha], True)),
                "op_dispatch": lambda: torch.ops.fp4lab.bench_noop.default(a, b, [alpha], True),
                "alpha_product": lambda: torch.mul(*pair)}
    times = {name: [] for name in calls_of}
    for _ in range(rounds):
        for name, fn in calls_of.items():
            times[name].append(host_us(fn, calls))
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="d12")
    parser.add_argument("--tokens", type=int, default=16 * 1024)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_dense_gemm.py times CUDA kernels: run it on a GPU")
    from fp4lab.nn import model_config
    cfg = model_config(args.model)
    saved = matmul.CUBLASLT
    pair = (torch.tensor(1.7e-3, device="cuda"), torch.tensor(3.1e-4, device="cuda"))
    rows, totals = [], {"cublaslt": 0.0, "triton": 0.0, "torch_mm": 0.0}
    try:
        for (m, k, n), count in block_gemms(cfg.dim, cfg.mlp_hidden, 3 * cfg.dim, args.tokens).items():
            a = torch.randn(m, k, device="cuda").bfloat16()
            b = torch.randn(n, k, device="cuda").bfloat16()
            outs, ms = {}, {}
            for name, lt in (("cublaslt", True), ("triton", False)):
                call = _scaled(a, b, pair, lt)
                outs[name] = call()  # (the plan is made outside the graph capture)
                ms[name] = graph_ms(call)
            ms["torch_mm"] = graph_ms(lambda: torch.mm(a, b.T))
            ref = (a.double() @ b.double().T) * (pair[0] * pair[1]).double()
            errors = {name: float((out.double() - ref).abs().max() / ref.abs().max()) for name, out in outs.items()}
            same = float((outs["cublaslt"].view(torch.int16) == outs["triton"].view(torch.int16)).float().mean())
            for name in totals:
                totals[name] += count * ms[name]
            rows.append({"m": m, "k": k, "n": n, "count": count, **{f"{key}_ms": v for key, v in ms.items()},
                         "same_bits": same, **{f"{key}_rel_error": v for key, v in errors.items()}})
            print(f"{m:6d} x {k:6d} x {n:6d} (x{count}) cuBLASLt {ms['cublaslt'] * 1e3:7.1f} us  "
                  f"Triton {ms['triton'] * 1e3:7.1f}  torch.mm {ms['torch_mm'] * 1e3:7.1f}  "
                  f"Triton / cuBLASLt {ms['triton'] / ms['cublaslt']:.3f}  cuBLASLt / torch.mm "
                  f"{ms['cublaslt'] / ms['torch_mm']:.3f}  same bits {same:.4f}  rel error {errors['cublaslt']:.2e} / "
                  f"{errors['triton']:.2e}", flush=True)
        print("one block's GEMMs (ms):", {key: round(v, 4) for key, v in totals.items()},
              f"Triton / cuBLASLt {totals['triton'] / totals['cublaslt']:.3f}")
        a = torch.randn(512, 512, device="cuda").bfloat16()
        b = torch.randn(512, 512, device="cuda").bfloat16()
        host = _host_costs(a, b, pair)
        print("host time a call at 512^3 (us, median of 7 interleaved rounds):",
              {key: round(v, 1) for key, v in host.items()})
    finally:
        matmul.CUBLASLT = saved
    save("dense_gemm", {**environment(), "model": args.model, "tokens": args.tokens, "rows": rows,
                        "block_ms": totals, "host_us_512": host})


if __name__ == "__main__":
    main()
