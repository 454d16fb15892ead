"""check_gemm: climb a ladder of exact cases with a candidate FP4 GEMM, stop at the first wrong
rung with a diagnosis, then measure its error on random operands of several shapes.

The candidate's contract is in operands.py (packed codes, plain or swizzled block scales, alpha;
C = A @ B^T [m, n] float32); the reference is formats.scaled_mm. Rungs, in order:

    uniform, alpha, identity, one_hot, scale_positions   exact (ladder.py): bit for bit
    random          random codes (all 16), random scale bytes, a random alpha, at the ladder shape
    random_shapes   the same at every shape of ``shapes``

Random cases pass when every output is within the bound of two FP32 summation orders (the
reference accumulates block by block; a kernel may sum in any order) plus alpha's rounding::

    |C - C_ref| <= (2 K + 2) * 2^-24 * (|A| @ |B|^T) * |alpha|      A, B dequantized, exact

The passing result reports, per shape, max |C - C_ref|, that over max |C_ref| (max_rel) and the
worst ratio of error to bound. fp4lab's GEMMs pass: formats.scaled_mm (bit for bit even on random
data), formats.emulated_mm, and kernels.fp4_mm, fused and two_stage, under TRITON_INTERPRET=1 and
on an H100 (max relative error 4.7e-7 NVFP4, 8.5e-7 MXFP4 at 512x384x1024).

Public: ``check_gemm``, ``DEFAULT_SHAPES``, ``EXACT_SHAPE``.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from ..formats import Format, ScaleLayout, decode_e2m1
from .ladder import RUNGS, Case, ContractError, Ladder
from .operands import GemmFn, pack_operand, reference_gemm
from .result import CheckResult

EXACT_SHAPE = (136, 40, 160)  # m past one 128-row tile, nb = 10 (NVFP4) / 5 (MXFP4): padded columns
DEFAULT_SHAPES = ((1, 1, 32), (7, 5, 64), (33, 17, 96), (130, 70, 160), (64, 256, 512))


def _call(fn: GemmFn, ld: Ladder, case: Case, layout: ScaleLayout, device) -> torch.Tensor:
    a_codes, a_scales = (t.to(device) for t in pack_operand(case.a, case.sa, ld.fmt, layout))
    b_codes, b_scales = (t.to(device) for t in pack_operand(case.b, case.sb, ld.fmt, layout))
    alpha = torch.tensor(case.alpha, dtype=torch.float32, device=device)
    try:
        out = fn(a_codes, a_scales, b_codes, b_scales, alpha, ld.m, ld.n, ld.k)
    except Exception as exc:  # a candidate's crash is a finding, reported at its rung
        raise ContractError(f"the GEMM raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (ld.m, ld.n) or out.dtype != torch.float32:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ContractError(f"the GEMM must return a [{ld.m}, {ld.n}] float32 tensor, got {got}")
    return out.detach().cpu()


def _run(fn: GemmFn, ld: Ladder, device, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    expected = _call(reference_gemm, ld, case, ScaleLayout.PLAIN, "cpu")
    return expected, _call(fn, ld, case, ld.layout, device)


def _random_case(ld: Ladder, g: torch.Generator) -> Case:
    lo, hi = (0x20, 0x58) if ld.fmt is Format.NVFP4 else (117, 137)  # scales 2^-3 .. 2^4, 2^-10 .. 2^9
    codes = [torch.randint(0, 16, (r, ld.k), generator=g, dtype=torch.uint8) for r in (ld.m, ld.n)]
    scales = [torch.randint(lo, hi, (r, ld.nb), generator=g, dtype=torch.uint8) for r in (ld.m, ld.n)]
    alpha = float(torch.empty((), dtype=torch.float32).uniform_(0.25, 4.0, generator=g))
    return Case(codes[0], scales[0], codes[1], scales[1], alpha)


def _values(ld: Ladder, codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    scale = ld.fmt.spec.decode_scale(scale_bytes).double()
    return (decode_e2m1(codes).double().reshape(codes.shape[0], ld.nb, ld.bl) * scale[..., None]).reshape(codes.shape)


def _random_check(fn: GemmFn, ld: Ladder, device, g: torch.Generator) -> tuple[dict, tuple[str, dict] | None]:
    case = _random_case(ld, g)
    expected, got = _run(fn, ld, device, case)
    a, b = _values(ld, case.a, case.sa), _values(ld, case.b, case.sb)
    bound = (2 * ld.k + 2) * 2.0**-24 * (a.abs() @ b.abs().T) * abs(case.alpha) + 1e-300
    err = (got.double() - expected.double()).abs()
    scale = float(expected.abs().max()) or 1.0
    stats = dict(shape=f"{ld.m}x{ld.n}x{ld.k}", max_abs=float(err.max()), max_rel=float(err.max()) / scale,
                 worst_over_bound=float((err / bound).max()))
    bad = ~(err <= bound)
    if not bad.any():
        return stats, None
    i, j = (int(v) for v in bad.nonzero()[0])
    return stats, (f"random operands {stats['shape']}, alpha {case.alpha:g}: C[{i}, {j}] = {float(got[i, j]):g}, "
                   f"reference {float(expected[i, j]):g}, error {float(err[i, j]):.3g} exceeds the FP32 summation "
                   f"bound {float(bound[i, j]):.3g}; {int(bad.sum())} of {ld.m * ld.n} outputs out of bound",
                   dict(row=i, col=j, expected=float(expected[i, j]), got=float(got[i, j]),
                        error=float(err[i, j]), bound=float(bound[i, j]), wrong_outputs=int(bad.sum()), **stats))


def check_gemm(fn: GemmFn, *, fmt: str | Format = "nvfp4", layout: str | ScaleLayout = "plain",
               shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES,
               exact_shape: tuple[int, int, int] = EXACT_SHAPE, seed: int = 0,
               device: torch.device | str = "cpu") -> CheckResult:
    """Check ``fn(a_codes, a_scales, b_codes, b_scales, alpha, m, n, k) -> C [m, n] float32``.

    fmt: "nvfp4" | "mxfp4"; layout: "plain" | "swizzled" (how fn receives the scales);
    exact_shape: (m, n, k) of the exact rungs; shapes: (m, n, k) of the random rung;
    device: where fn's operands are put (the reference runs on the CPU).
    """
    fmt, layout = Format.parse(fmt), ScaleLayout.parse(layout)
    ladders = [Ladder(fmt, layout, *exact_shape)] + [Ladder(fmt, layout, *s) for s in shapes]
    for ld in ladders:
        if min(ld.m, ld.n, ld.k) < 1 or ld.k % ld.bl:
            raise ValueError(f"shape (m={ld.m}, n={ld.n}, k={ld.k}): m, n, k must be positive and K divisible "
                             f"by the {fmt} block size {ld.bl}")
    subject = f"check_gemm {getattr(fn, '__name__', 'fn')} {fmt}/{layout}"
    g = torch.Generator().manual_seed(seed)
    passed, rung = [], "uniform"
    try:
        for rung, check in RUNGS:
            failure = check(ladders[0], partial(_run, fn, ladders[0], device))
            if failure is not None:
                return CheckResult(ok=False, rung=rung, message=failure[0], details=failure[1], subject=subject)
            passed.append(rung)
        stats = []
        for rung, ld in [("random", ladders[0])] + [("random_shapes", ld) for ld in ladders[1:]]:
            shape_stats, failure = _random_check(fn, ld, device, g)
            if failure is not None:
                return CheckResult(ok=False, rung=rung, message=failure[0], details=failure[1], subject=subject)
            stats.append(shape_stats)
    except ContractError as exc:
        return CheckResult(ok=False, rung=rung, message=str(exc), details={}, subject=subject)
    worst = max(s["max_rel"] for s in stats)
    return CheckResult(ok=True, rung=None, subject=subject,
                       message=f"exact rungs bit-exact ({', '.join(passed)}); {len(stats)} random cases within the "
                               f"FP32 summation bound, max relative error {worst:.3g}",
                       details={"exact_shape": "x".join(map(str, exact_shape)), "random": stats})
