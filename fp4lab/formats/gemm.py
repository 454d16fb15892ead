"""The reference block-scaled FP4 GEMM, C = A @ B^T, and its BF16 emulation.

Both operands are quantized along K, the contraction axis, and stored K-last: A is [M, K]
quantized along axis 1 (stored [M, K/2]) or A^T, a [K, M] tensor quantized along axis 0 (stored
the same way: TE's columnwise copy); likewise B. A 16x16-tiled weight works the same. ``scaled_mm`` follows the
hardware semantics (docs/numerics.md "Scaled GEMM semantics")::

    acc[m, n] = sum over blocks j, in order j = 0, 1, ...:
                (sum_i a_code[m, j, i] * b_code[n, j, i]) * (sa[m, j] * sb[n, j])   fp32
    C = acc * alpha,  alpha = S_dec_A * S_dec_B  (NVFP4; 1 for MXFP4), applied once

Within a block the 16 (or 32) code products are multiples of 1/4 below 2^12, and the scale
product has an 8-bit significand, so every term is exact in fp32: the only roundings are the
block-by-block fp32 accumulation and the alpha multiply, which makes the result a deterministic
function of the operands on every device. (MXFP4 scale products beyond fp32's range overflow;
real scales never get there.)

``emulated_mm`` is what a Hopper kernel does: decode code * block scale to BF16 (exact), one
matmul with FP32 accumulation, alpha after. It agrees with ``scaled_mm`` up to the order of the
fp32 summation; the all-1.5 case (every code 1.5, every scale 1, K = 32 -> 72.0) is exact in both.

Public: ``scaled_mm``, ``emulated_mm``, ``gemm_alpha``.
"""

from __future__ import annotations

import torch

from .codes import decode_e2m1, unpack_nibbles
from .dequantize import block_scales, block_values
from .types import FP4Tensor


def _operand(q: FP4Tensor, name: str) -> int:
    """Check one GEMM operand; return its row count (M for A, N for B): the axis not quantized."""
    if not isinstance(q, FP4Tensor):
        raise TypeError(f"{name} must be an FP4Tensor, got {type(q).__name__}")
    if len(q.shape) != 2:
        raise ValueError(f"{name} must be a quantized 2D tensor, got shape {tuple(q.shape)}")
    return q.shape[1 - q.axis]


def _check_pair(qa: FP4Tensor, qb: FP4Tensor) -> tuple[int, int]:
    m, n = _operand(qa, "qa"), _operand(qb, "qb")
    if qa.format is not qb.format or qa.block_len != qb.block_len:
        raise ValueError(f"operands must share a format and block length, got {qa.format}/"
                         f"{qa.block_len} and {qb.format}/{qb.block_len}")
    if qa.shape[qa.axis] != qb.shape[qb.axis] or qa.padded_len != qb.padded_len:
        raise ValueError(f"K mismatch: qa is {tuple(qa.shape)}, qb is {tuple(qb.shape)}")
    return m, n


def gemm_alpha(qa: FP4Tensor, qb: FP4Tensor) -> torch.Tensor:
    """[] float32 S_dec_A * S_dec_B for NVFP4 operands, 1 for MXFP4."""
    if qa.tensor_scale is None or qb.tensor_scale is None:
        return torch.ones((), dtype=torch.float32, device=qa.codes.device)
    return qa.tensor_scale * qb.tensor_scale


def scaled_mm(qa: FP4Tensor, qb: FP4Tensor, *, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """qa: A [M, K], qb: B [N, K], both quantized along K -> C = A @ B^T: [M, N] ``out_dtype``."""
    m, n = _check_pair(qa, qb)
    bl, nb = qa.block_len, qa.padded_len // qa.block_len
    a = decode_e2m1(unpack_nibbles(qa.codes[:m])).reshape(m, nb, bl)
    b = decode_e2m1(unpack_nibbles(qb.codes[:n])).reshape(n, nb, bl)
    sa, sb = block_scales(qa)[:m], block_scales(qb)[:n]  # [M, nb], [N, nb]
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for j in range(a.shape[1]):
        partial = a[:, j, :] @ b[:, j, :].T  # exact: multiples of 1/4 below 2^12
        acc += partial * (sa[:, j, None] * sb[None, :, j])
    return (acc * gemm_alpha(qa, qb)).to(out_dtype)


def emulated_mm(qa: FP4Tensor, qb: FP4Tensor, *, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """As ``scaled_mm``, via exact BF16 operands and one FP32-accumulated matmul."""
    m, n = _check_pair(qa, qb)
    a = block_values(qa)[:m].to(torch.bfloat16)  # code * block scale: exact in bf16
    b = block_values(qb)[:n].to(torch.bfloat16)
    acc = a.to(torch.float32) @ b.to(torch.float32).T
    return (acc * gemm_alpha(qa, qb)).to(out_dtype)
