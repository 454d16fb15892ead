"""The contract a candidate FP4 GEMM is checked against, and adapters for fp4lab's own GEMMs.

A candidate is a callable::

    fn(a_codes, a_scales, b_codes, b_scales, alpha, m, n, k) -> C: [m, n] float32

    a_codes   [m, k/2] uint8, two E2M1 codes per byte, element 2i in the low nibble
    a_scales  NVFP4: float8_e4m3fn, MXFP4: uint8 UE8M0; plain [m, k/block] (row-major, block j
              of row r at [r, j]) or swizzled: the flat [Rp * Kp] buffer of formats.layout
              (128x4 tiles, zero padded to Rp = ceil(m/128)*128, Kp = ceil((k/block)/4)*4)
    b_codes, b_scales   the same for B [n, k]
    alpha     [] float32, applied once to the accumulator
    C[i, j] = alpha * sum_blocks (sum_e a[i, e] * b[j, e]) * sa[i, blk] * sb[j, blk]

which is formats.scaled_mm with alpha as the product of the tensor scales (NVFP4); for MXFP4
(no tensor scale) the adapters multiply the result by alpha once, the same single rounding.
The format is told by the scale dtype (block 16 for float8_e4m3fn, 32 for uint8) and the layout
by the scale rank (2: plain, 1: swizzled).

Public: ``GemmFn``, ``fp4_operand``, ``pack_operand``, ``as_gemm_fn``, ``reference_gemm``,
``emulated_gemm``, ``kernels_gemm``, ``format_of``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import kernels
from ..formats import FORMAT_SPECS, FP4Tensor, Format, ScaleLayout, emulated_mm, pack_nibbles, scaled_mm, swizzle_scales
from ..formats.layout import _padded

GemmFn = Callable[..., torch.Tensor]


def format_of(scales: torch.Tensor) -> Format:
    """The format a scale tensor's dtype implies: float8_e4m3fn -> NVFP4, uint8 -> MXFP4."""
    for fmt, spec in FORMAT_SPECS.items():
        if scales.dtype == spec.scale_dtype:
            return fmt
    raise TypeError(f"block scales must be float8_e4m3fn (NVFP4) or uint8 (MXFP4), got {scales.dtype}")


def fp4_operand(codes: torch.Tensor, scales: torch.Tensor, rows: int, k: int,
                tensor_scale: float | torch.Tensor = 1.0) -> FP4Tensor:
    """Packed codes [rows, k/2] uint8 + scales (plain [rows, k/block] or swizzled flat) -> FP4Tensor
    [rows, k] quantized along k. ``tensor_scale`` is kept for NVFP4 and ignored for MXFP4."""
    fmt = format_of(scales)
    block = fmt.spec.block_len
    if k % block:
        raise ValueError(f"K = {k} is not divisible by the {fmt} block size {block}")
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (rows, k // 2):
        raise ValueError(f"codes must be uint8 [{rows}, {k // 2}], got {codes.dtype} {tuple(codes.shape)}")
    nb = k // block
    rp, kp = _padded(rows, nb)
    if scales.dim() == 2 and tuple(scales.shape) == (rows, nb):
        layout = ScaleLayout.PLAIN
    elif scales.dim() == 1 and scales.numel() == rp * kp:
        layout = ScaleLayout.SWIZZLED
    else:
        raise ValueError(f"{fmt} scales for [{rows}, {k}] must be plain [{rows}, {nb}] or swizzled "
                         f"[{rp * kp}], got {tuple(scales.shape)}")
    ts = None
    if fmt.spec.tensor_scale:
        ts = torch.as_tensor(tensor_scale, dtype=torch.float32, device=codes.device).reshape(())
    return FP4Tensor(codes=codes, scales=scales, tensor_scale=ts, shape=(rows, k), axis=1,
                     block=(1, block), format=fmt, rounding="rtne",
                     profile="te" if fmt is Format.NVFP4 else None,
                     mx_mode="floor" if fmt is Format.MXFP4 else None, scale_layout=layout)


def pack_operand(codes: torch.Tensor, scale_bytes: torch.Tensor, fmt: Format,
                 layout: ScaleLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [rows, k] uint8 (one code each), scale_bytes [rows, k/block] uint8 -> the candidate's
    (packed codes [rows, k/2], scales in ``fmt``'s dtype and ``layout``)."""
    scales = scale_bytes.view(fmt.spec.scale_dtype)
    if layout is ScaleLayout.SWIZZLED:
        scales = swizzle_scales(scales)
    return pack_nibbles(codes), scales


def as_gemm_fn(mm: Callable[[FP4Tensor, FP4Tensor], torch.Tensor]) -> GemmFn:
    """Wrap ``mm(qa, qb) -> C`` (formats.gemm's operand convention) as a candidate callable."""
    def fn(a_codes, a_scales, b_codes, b_scales, alpha, m, n, k):
        qa = fp4_operand(a_codes, a_scales, m, k, tensor_scale=alpha)
        qb = fp4_operand(b_codes, b_scales, n, k)
        out = mm(qa, qb)
        return out if qa.format.spec.tensor_scale else out * alpha.to(out.device)  # alpha rode in the tensor scale
    fn.__name__ = getattr(mm, "__name__", "gemm")
    return fn


reference_gemm = as_gemm_fn(scaled_mm)
"""formats.scaled_mm (the spec) as a candidate."""
emulated_gemm = as_gemm_fn(emulated_mm)
"""formats.emulated_mm (BF16 operands, one FP32 matmul) as a candidate."""


def kernels_gemm(backend: str = "reference", **kwargs) -> GemmFn:
    """kernels.fp4_mm on ``backend`` ("reference" | "triton" | "auto"; extra keywords such as
    ``method=`` go to the kernel) as a candidate."""
    def mm(qa, qb):
        return kernels.fp4_mm(qa, qb, backend=backend, **kwargs)
    mm.__name__ = f"kernels.fp4_mm[{backend}]"
    return as_gemm_fn(mm)
