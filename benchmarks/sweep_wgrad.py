"""Tile sweep of the MoE wgrad launch (kernels.matmul._contraction_grouped_kernel) at moe64's shapes.

    python benchmarks/sweep_wgrad.py

moe64's expert wgrad: 64 experts, 49,152 routed rows (uneven), dW_e [256, 512] and [512, 256],
each expert contracting its own tokens padded to 32 (EVEN_K off) or, as a variant, to 64 (EVEN_K
on). For each (BM, BN, BK, warps, stages): device time from graph replays (no host), TFLOP/s and
the ratio to BF16's torch._grouped_mm on the same contraction. A BK of 64 keeps the summation
order of the dense pointer kernel (the bit-equality the tests check); other BKs are listed for
what they would buy. Writes benchmarks/results/sweep_wgrad.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_gemm import uneven  # noqa: E402
from benchmarks.common import environment, graph_ms, save  # noqa: E402
from fp4lab.kernels import matmul  # noqa: E402

CONFIGS = [(256, 128, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3),
           (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 64, 64, 4, 3), (128, 128, 64, 4, 2),
           (128, 256, 64, 8, 3), (128, 128, 32, 4, 4), (64, 64, 32, 4, 4)]


def launch(a, b, widths_t, starts_t, alpha, out, cfg, even_k):
    bm, bn, bk, warps, stages = cfg
    m, n = a.shape[0], b.shape[0]
    grid = (len(alpha) * triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    matmul._contraction_grouped_kernel[grid](a, b, out, alpha, starts_t, widths_t, m, n, a.stride(0), a.stride(1),
                                             b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
                                             BF16_OUT=True, EVEN_K=even_k, DOT_F32=False, BM=bm, BN=bn, BK=bk,
                                             num_warps=warps, num_stages=stages)


def main() -> None:
    rows = []
    for multiple in (32, 64):
        widths = [s + (-s % multiple) for s in uneven(64, 49152, 1)]
        starts = [0]
        for w in widths[:-1]:
            starts.append(starts[-1] + w)
        widths_t = torch.tensor(widths, device="cuda", dtype=torch.int32)
        starts_t = torch.tensor(starts, device="cuda", dtype=torch.int32)
        alpha = torch.ones(64, device="cuda")
        for m, n in ((256, 512), (512, 256)):
            a = torch.randn(m, sum(widths), device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, sum(widths), device="cuda", dtype=torch.bfloat16)
            out = torch.empty(64, m, n, device="cuda", dtype=torch.bfloat16)
            flops = 2 * sum(widths) * m * n
            offs = torch.tensor(widths, device="cuda").cumsum(0).to(torch.int32)
            a_t, b_t = a.T.contiguous(), b.T.contiguous()
            bf16 = graph_ms(lambda: torch._grouped_mm(a_t.T, b_t, offs=offs))
            reference = None
            for cfg in CONFIGS:
                even = multiple % cfg[2] == 0
                try:
                    ms = graph_ms(lambda: launch(a, b, widths_t, starts_t, alpha, out, cfg, even))
                except Exception as exc:  # a tile that does not fit in shared memory, say
                    print(f"pad {multiple} {m}x{n} {cfg}: failed {type(exc).__name__}")
                    continue
                same = None
                if cfg[2] == 64:  # same BK: the same per-element summation, so the same bits
                    if reference is None:
                        reference = out.clone()
                    same = bool(torch.equal(out, reference))
                rows.append({"pad": multiple, "m": m, "n": n, "cfg": cfg, "even_k": even, "ms": ms,
                             "tflops": flops / ms / 1e9, "over_bf16": bf16 / ms, "same_bits_as_first": same})
                print(f"pad {multiple:2d} dW {m}x{n} BM{cfg[0]} BN{cfg[1]} BK{cfg[2]} w{cfg[3]} s{cfg[4]} "
                      f"even_k={even!s:5s} {ms:.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  x{bf16 / ms:.2f} of bf16 "
                      f"({bf16:.3f} ms){'' if same is None else f'  bits {same}'}", flush=True)
    save("sweep_wgrad", {**environment(), "rows": rows})


if __name__ == "__main__":
    main()
