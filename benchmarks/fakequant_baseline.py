"""The torch.compile'd fake-quant baseline of the NVFP4 linear step: "what a user would write".

    python benchmarks/fakequant_baseline.py [--shape M K N] [--device cpu]   # compile time, bitwise check

The step quantizes the six GEMM operands of NVIDIA's recipe (arXiv 2509.25149, TE
NVFP4BlockScaling) with the pure-PyTorch reference ``fp4lab.formats.quantize_nvfp4``, dequantizes
them back to BF16, and runs three BF16 GEMMs (no fp4lab.kernels anywhere)::

    fprop  y  = x @ W^T      x: 1x16 RTNE along K;   W: 16x16 RTNE along K
    dgrad  dx = dy @ W       dy: 1x16 SR (seed 1);   W: 16x16 RTNE along N (axis 0)
    wgrad  dW = dy^T @ x     dy (SR, seed 2) and x (RTNE), along M after the 16-point RHT (TE signs)

What made ``torch.compile(step)`` impractical (formats has no graph break or host sync on this
path: torch 2.13's explain gives one graph of 1335 ops, no recompiles; over 6 min on an H100):

1. Stochastic rounding's Philox (rng.random_bytes): ten rounds of int64 ops on a counter made by
   ``torch.arange`` read no buffer, so Inductor never materializes an intermediate and inlines
   each round into the next; its lowering grows ~2.5x per round (CPU, 256x256: 4 s for 3 rounds,
   49 s for 7, random_bytes alone not done in 15 min; the whole step not done in 25 min at 12 GB).
   Fix: ``_fake_quant_sr`` composes quantize_nvfp4 from the functions it calls and feeds
   ``rng.philox4x32`` a counter that is a graph input (made eagerly, one arange per step): the
   same bytes, compiled in seconds.
2. The 16-point RHT (formats.hadamard_transform) compiled by Inductor for CUDA gives wrong values
   (torch 2.11 + Triton 3.6 on H100: elements 4 and 12 of every 16-chunk, relative error up to
   1e7, at 1024x1024, 64x4096, 8192x64 and 8192x4096; right at 64x64, 256x256 and on CPU).
   So the RHT runs eagerly (``_rht``) and only the quantization of the rotated tensor is
   compiled; quantize_nvfp4(hadamard="te") does exactly that rotation first (same bits).

Bitwise check (``main``): CPU (torch 2.13, 256^3) y, dx, dW and all six operands equal eager.
H100 (torch 2.11, Triton 3.6, 8192 x 4096 x 4096): y, dx and five operands equal; wgrad's x differs
in 2731 of 33.5M elements, each one E2M1 step at a tie (0.238 eager vs 0.477 compiled), so dW
differs. Inductor's eager-division option (div_rn for fp32 x / y) did not remove it; cause open.

Each operand's fake quantization is its own named function, compiled separately with
``fullgraph=True, dynamic=False``: six small graphs, one cache entry each (a distinct code
object per operand, so no recompiles on guards over kwargs or seeds) and static shapes. The GEMMs
stay eager, which is what Inductor would emit anyway (extern mm). Compile + first call: 26-37 s
on the H100 at 8192 x 4096 x 4096 (cold cache), 23-28 s on a 2-core CPU at 256^3.

Public: ``make_fakequant_step``, ``fakequant_step`` (the eager reference: six quantize_nvfp4 calls).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp4lab import formats  # noqa: E402
from fp4lab.formats import blocks, nvfp4, rng  # noqa: E402
from fp4lab.formats.codes import E4M3_NAN  # noqa: E402


def _fake_quant(t: torch.Tensor, **kw) -> torch.Tensor:
    """t: [R, C] bf16 -> [R, C] bf16, quantized to NVFP4 by the reference and dequantized."""
    return formats.dequantize(formats.quantize_nvfp4(t, **kw), torch.bfloat16)


def _fake_quant_sr(t: torch.Tensor, counter: torch.Tensor, *, seed: int, axis: int = -1) -> torch.Tensor:
    """``_fake_quant(t, axis=axis, rounding="stochastic", seed=seed)``, composed from the functions
    quantize_nvfp4 calls, with the Philox counter an input instead of an arange.

    t: [R, C] bf16; counter: [t.numel() // 16] int64, arange -> [R, C] bf16 (module docstring, 1.)
    """
    xm, axis = blocks.prepare(t, axis, (1, 16), pad=False)  # [*lead, L] float32, axis last
    xb = blocks.blocks_of(xm, 16)  # [*lead, L / 16, 16]
    b_amax, bad = blocks.block_amax(xb, 1)  # [*lead, L / 16]
    s_dec, block_mult = nvfp4.nvfp4_tensor_terms(blocks.finite_amax(xm), formats.NVFP4Profile.TE)
    scales, e_b = nvfp4.nvfp4_block_scales(b_amax, s_dec, block_mult, formats.NVFP4Profile.TE)
    scaled = torch.clamp(xb * e_b[..., None], -6.0, 6.0).reshape(xm.shape)
    # rng.random_bytes(seed, xm.numel()) with the counter passed in
    words = torch.stack(rng.philox4x32(seed, counter), dim=-1)  # [L * R / 16, 4]
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=t.device)
    rand = ((words[..., None] >> shifts) & 0xFF).reshape(-1)[:xm.numel()].to(torch.uint8)
    codes = formats.encode_e2m1(scaled, rand.reshape(xm.shape))
    codes = torch.where(bad[..., None], 0, blocks.blocks_of(codes, 16)).reshape(xm.shape)
    scales = torch.where(bad, E4M3_NAN, scales.view(torch.uint8)).view(torch.float8_e4m3fn)
    q = formats.FP4Tensor(codes=formats.pack_nibbles(codes), scales=scales, tensor_scale=s_dec,
                          shape=t.shape, axis=axis, block=(1, 16), format=formats.Format.NVFP4,
                          rounding=formats.Rounding.STOCHASTIC, profile=formats.NVFP4Profile.TE)
    return formats.dequantize(q, torch.bfloat16)


def fprop_x(x):  # x: [M, K], 1x16 RTNE along K
    return _fake_quant(x)


def fprop_w(w):  # W: [N, K], 16x16 RTNE along K
    return _fake_quant(w, block=(16, 16))


def dgrad_dy(dy, counter):  # dy: [M, N], 1x16 SR along N
    return _fake_quant_sr(dy, counter, seed=1)


def dgrad_w(w):  # W: [N, K], 16x16 RTNE along N
    return _fake_quant(w, block=(16, 16), axis=0)


def wgrad_dy(dy_rht, counter):  # dy after the RHT along M: [M, N], 1x16 SR along M
    return _fake_quant_sr(dy_rht, counter, axis=0, seed=2)


def wgrad_x(x_rht):  # x after the RHT along M: [M, K], 1x16 RTNE along M
    return _fake_quant(x_rht, axis=0)


def _rht(t):  # [M, C] bf16 -> [M, C] bf16: the 16-point RHT (TE signs) along M, as quantize_nvfp4 applies it
    return formats.hadamard_transform(t, axis=0, size=16, signs="te")


OPERANDS = (fprop_x, fprop_w, dgrad_dy, dgrad_w, wgrad_dy, wgrad_x)


def _step(q, x, w, dy):
    """q: the six operand functions in OPERANDS order; x: [M, K], w: [N, K], dy: [M, N] bf16."""
    q_fprop_x, q_fprop_w, q_dgrad_dy, q_dgrad_w, q_wgrad_dy, q_wgrad_x = q
    counter = torch.arange(dy.numel() // 16, dtype=torch.int64, device=dy.device)  # Philox groups
    y = q_fprop_x(x) @ q_fprop_w(w).T  # [M, N]
    dx = q_dgrad_dy(dy, counter) @ q_dgrad_w(w)  # [M, K]
    dw = q_wgrad_dy(_rht(dy), counter).T @ q_wgrad_x(_rht(x))  # [N, K]; the RHT runs eagerly
    return y, dx, dw


def _reference_operands(x, w, dy):
    """The six operands as the step was first written, every one a plain quantize_nvfp4 call."""
    fq = _fake_quant
    return (fq(x), fq(w, block=(16, 16)), fq(dy, rounding="stochastic", seed=1),
            fq(w, block=(16, 16), axis=0), fq(dy, axis=0, hadamard="te", rounding="stochastic", seed=2),
            fq(x, axis=0, hadamard="te"))


def fakequant_step(x, w, dy):
    """The eager reference: (x, w, dy) -> (y, dx, dw), all bf16, from quantize_nvfp4 calls only."""
    x_fprop, w_fprop, dy_dgrad, w_dgrad, dy_wgrad, x_wgrad = _reference_operands(x, w, dy)
    return x_fprop @ w_fprop.T, dy_dgrad @ w_dgrad, dy_wgrad.T @ x_wgrad


def make_fakequant_step():
    """-> (x, w, dy) -> (y, dx, dw): the step with each operand's fake quantization compiled.

    Compiling happens on the first call (per shape and device)."""
    compiled = tuple(torch.compile(f, fullgraph=True, dynamic=False) for f in OPERANDS)
    return functools.partial(_step, compiled)  # .args[0]: the compiled operand functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=(256, 256, 256), metavar=("M", "K", "N"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    m, k, n = args.shape
    x = torch.randn(m, k, generator=gen).to(args.device, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(args.device, torch.bfloat16)
    dy = (torch.randn(m, n, generator=gen) * 1e-3).to(args.device, torch.bfloat16)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    step = make_fakequant_step()
    start = time.perf_counter()
    out = step(x, w, dy)
    sync()
    compile_s = time.perf_counter() - start
    ref = fakequant_step(x, w, dy)
    same = {name: torch.equal(a, b) for name, a, b in zip(("y", "dx", "dw"), out, ref)}
    counter = torch.arange(dy.numel() // 16, dtype=torch.int64, device=dy.device)
    inputs = ((x,), (w,), (dy, counter), (w,), (_rht(dy), counter), (_rht(x),))
    operands = {f.__name__: torch.equal(fc(*a), r)
                for f, fc, a, r in zip(OPERANDS, step.args[0], inputs, _reference_operands(x, w, dy))}
    print(f"{args.device} M, K, N = {m}, {k}, {n}: compile + first call {compile_s:.1f} s; "
          f"bitwise equal to eager: {same}; operands: {operands}")


if __name__ == "__main__":
    main()
