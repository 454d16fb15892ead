"""Triton dequantize (and the quantize-dequantize "fake quant" built on it), byte-identical to
fp4lab.formats.dequantize: value = (e2m1 * block_scale) * tensor_scale, then one cast.

Works in the stored layout [rows, Lp] and hands back the same view the reference returns
(padding cropped, block axis moved back). Swizzled scales are unswizzled first.

Public: ``dequantize``, ``block_values``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.blocks import restore
from ..formats.dequantize import check_dequantize_args
from ..formats.layout import with_scale_layout
from ..formats.types import Format, FP4Tensor, ScaleLayout
from .elements import e2m1_value, scale_value, to_bf16_rtne
from .host import cdiv
from .launch import cached

_OUT_DTYPES = (torch.float32, torch.bfloat16)


@cached  # (launched through kernels.launch)
@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, tscale_ptr, out_ptr, ROWS, LP,
                       BLOCK: tl.constexpr, NVFP4: tl.constexpr, TENSOR_SCALE: tl.constexpr, BF16: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr):
    NB: tl.constexpr = BC // BLOCK
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    pcols = tl.program_id(1) * (BC // 2) + tl.arange(0, BC // 2)
    keep = rows[:, None] < ROWS
    packed = tl.load(codes_ptr + rows[:, None] * (LP // 2) + pcols[None, :],
                     mask=keep & (pcols[None, :] < LP // 2), other=0).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BR, NB, BLOCK))
    scols = tl.program_id(1) * NB + tl.arange(0, NB)
    sbyte = tl.load(scales_ptr + rows[:, None] * (LP // BLOCK) + scols[None, :],
                    mask=keep & (scols[None, :] < LP // BLOCK), other=0).to(tl.int32)
    values = tl.reshape(e2m1_value(codes) * scale_value(sbyte, NVFP4)[:, :, None], (BR, BC))
    if TENSOR_SCALE:
        values = values * tl.load(tscale_ptr)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    if BF16:
        values = to_bf16_rtne(values)
    tl.store(out_ptr + rows[:, None] * LP + cols[None, :], values,
             mask=keep & (cols[None, :] < LP))


def dequantize(q: FP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton twin of fp4lab.formats.dequantize."""
    check_dequantize_args(q, dtype)
    if dtype not in _OUT_DTYPES:  # e.g. float16: the fp32 result, cast once, as the reference does
        return dequantize(q, torch.float32).to(dtype)
    return restore(_decode(q, dtype, q.format is Format.NVFP4), q.shape, q.axis)


def block_values(q: FP4Tensor, dtype: torch.dtype = torch.bfloat16, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of fp4lab.formats.block_values: [*lead, Lp] code * block scale, no tensor
    scale; exact in bf16 (the operand of an emulated GEMM). ``out``: a contiguous buffer of that
    shape and dtype to write into (a slice of a grouped GEMM's operand)."""
    return _decode(q, dtype, False, out)


def _decode(q: FP4Tensor, dtype: torch.dtype, tensor_scale: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    q = with_scale_layout(q, ScaleLayout.PLAIN)
    rows, lp = q.lead_shape.numel(), q.padded_len
    if out is None:
        out = torch.empty(*q.lead_shape, lp, dtype=dtype, device=q.codes.device)
    elif out.shape != (*q.lead_shape, lp) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {(*q.lead_shape, lp)}")
    if out.numel():
        nvfp4 = q.format is Format.NVFP4
        br, bc = 32, 128
        grid = (cdiv(rows, br), cdiv(lp, bc))
        _dequantize_kernel[grid](q.codes, q.scales.view(torch.uint8), q.tensor_scale if tensor_scale else q.codes,
                                 out, rows, lp, BLOCK=q.block_len, NVFP4=nvfp4, TENSOR_SCALE=tensor_scale,
                                 BF16=dtype == torch.bfloat16, BR=br, BC=bc)
    return out
