"""Tile sweep of the dense FP4 GEMM (kernels.matmul.scaled_mm, BF16 block values) at a GPT's step shapes.

    python benchmarks/sweep_gemm.py [--model d12 --tokens 16384] [--kernels both]

The captured d12 step spends 16.3 ms in FP4 GEMMs where the BF16 GEMMs they replace take about
10.8 ms (benchmarks/NOTES.md, 2026-11-26): 1.5x, against 1.04x at 8192 x 4096 x 4096, where the
tile (256 x 128 x 64, 8 warps, 4 stages) was chosen. A step's GEMMs are short contractions (fprop
and dgrad: K = 768 or 2048) or small outputs (wgrad: [768, 768] is 18 tiles of 256 x 128 on 132
SMs). For each GEMM of one block's five linears (fprop, dgrad, wgrad) and each tile: device time
from graph replays, the ratio to cuBLAS BF16 (torch.mm) at the same shape, and whether the output
has the default tile's bits (BK stays 64, so each element is summed in the same order). Each tile
runs as the dense kernel matmul launches (``--kernels``: ``persistent``, one program an SM walking
the tiles, matmul.PERSISTENT; ``tiled``, one program a tile; ``both``, side by side). Ends with the
block's total under matmul's default (tile and kernel), under each shape's best, under each
kernel's best, and in BF16. Writes benchmarks/results/sweep_gemm.json.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, graph_ms, save  # noqa: E402
from fp4lab.kernels import matmul  # noqa: E402

# (BM, BN, BK, warps, stages); the first is matmul's default
CONFIGS = [(256, 128, 64, 8, 4), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
           (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (256, 64, 64, 8, 4),
           (256, 128, 64, 8, 3), (128, 256, 64, 8, 3)]


def block_gemms(dim: int, hidden: int, qkv: int, tokens: int) -> dict[tuple[int, int, int], int]:
    """(M, K, N) -> how many of one GPT block's FP4 GEMMs have that shape: its five linears (qkv,
    proj, gate, up, down: in -> out), each with fprop [T, in] x [out, in]^T, dgrad [T, out] x
    [in, out]^T and wgrad [out, T] x [in, T]^T."""
    counts: dict[tuple[int, int, int], int] = {}
    for inp, out in ((dim, qkv), (dim, dim), (dim, hidden), (dim, hidden), (hidden, dim)):
        for shape in ((tokens, inp, out), (tokens, out, inp), (out, tokens, inp)):
            counts[shape] = counts.get(shape, 0) + 1
    return counts


@contextmanager
def tile(cfg: tuple[int, int, int, int, int], persistent: bool | None = None):
    """matmul's dense tile set to ``cfg`` inside the block, for every output size, and its kernel
    (matmul.PERSISTENT; None: as it is), restored after. The Triton kernels run (cuBLASLt off)."""
    saved = (matmul._BM, matmul._BN, matmul._BK, matmul._WARPS, matmul._STAGES, matmul._LARGE_OUT, matmul._SMALL_OUT,
             matmul._TINY_OUT, matmul.PERSISTENT, matmul.CUBLASLT)
    matmul.CUBLASLT = False
    matmul._BM, matmul._BN, matmul._BK, matmul._WARPS, matmul._STAGES = cfg
    matmul._LARGE_OUT = matmul._SMALL_OUT = matmul._TINY_OUT = cfg
    if persistent is not None:
        matmul.PERSISTENT = persistent
    try:
        yield
    finally:
        (matmul._BM, matmul._BN, matmul._BK, matmul._WARPS, matmul._STAGES, matmul._LARGE_OUT, matmul._SMALL_OUT,
         matmul._TINY_OUT, matmul.PERSISTENT, matmul.CUBLASLT) = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="d12")
    parser.add_argument("--tokens", type=int, default=16 * 1024)
    parser.add_argument("--kernels", choices=("both", "persistent", "tiled"), default="both")
    args = parser.parse_args()
    kernels = {"both": (False, True), "persistent": (True,), "tiled": (False,)}[args.kernels]
    if not torch.cuda.is_available():
        raise SystemExit("sweep_gemm.py times CUDA kernels: run it on a GPU")
    from fp4lab.nn import model_config
    cfg = model_config(args.model)
    shapes = block_gemms(cfg.dim, cfg.mlp_hidden, 3 * cfg.dim, args.tokens)
    alpha = torch.ones((), device="cuda")
    default = "cuBLASLt" if matmul.CUBLASLT else "persistent" if matmul.PERSISTENT else "tiled"
    rows, totals = [], {"default": 0.0, "best": 0.0, "bf16": 0.0, **{_name(p): 0.0 for p in kernels}}
    for (m, k, n), count in shapes.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16 = graph_ms(lambda: torch.mm(a, b.T))
        with tile(CONFIGS[0], persistent=False):  # the bits every Triton tile and kernel is held to
            reference = matmul.scaled_mm(a, b, alpha)
        # matmul's default as launched at this shape (cuBLASLt on CUDA; else the Triton kernel at its tile)
        totals["default"] += count * graph_ms(lambda: matmul.scaled_mm(a, b, alpha))
        timed = {}
        for persistent in kernels:
            for c in CONFIGS:
                try:
                    with tile(c, persistent):
                        out = matmul.scaled_mm(a, b, alpha)
                        ms = graph_ms(lambda: matmul.scaled_mm(a, b, alpha))
                except Exception as exc:  # a tile that does not fit in shared memory, say
                    print(f"{m}x{k}x{n} {c} {_name(persistent)}: failed {type(exc).__name__}")
                    continue
                same = bool(torch.equal(out, reference))
                timed[c, persistent] = ms
                rows.append({"m": m, "k": k, "n": n, "count": count, "cfg": c, "kernel": _name(persistent), "ms": ms,
                             "bf16_ms": bf16, "over_bf16": ms / bf16, "same_bits_as_default": same})
                print(f"M{m} K{k} N{n} (x{count}) {_name(persistent):10s} BM{c[0]} BN{c[1]} BK{c[2]} w{c[3]} s{c[4]}: "
                      f"{ms * 1e3:7.1f} us, {ms / bf16:.2f}x cuBLAS BF16 ({bf16 * 1e3:.1f} us), "
                      f"bits {'same' if same else 'DIFFER'}", flush=True)
        totals["bf16"] += count * bf16
        if timed:
            totals["best"] += count * min(timed.values())
        for p in kernels:
            if mine := [ms for (_, q), ms in timed.items() if q == p]:
                totals[_name(p)] += count * min(mine)
    ratios = ", ".join(f"{key} {ms:.3f} ms ({ms / totals['bf16']:.2f}x)" for key, ms in totals.items() if key != "bf16")
    print(f"one block's 15 GEMMs (default: {default}): {ratios}; BF16 {totals['bf16']:.3f} ms")
    save("sweep_gemm", {**environment(), "model": args.model, "tokens": args.tokens, "rows": rows, "block_ms": totals})


def _name(persistent: bool) -> str:
    return "persistent" if persistent else "tiled"


if __name__ == "__main__":
    main()
