"""Emulated block-scaled FP4 GEMM on Hopper: C = A @ B^T from packed codes and block scales.

Hopper has no FP4 tensor cores, so each program streams packed E2M1 codes (half a byte per
element) and their block scales from memory, decodes code * block scale to BF16 in registers
(exact: a 2-bit by 4-bit significand), and feeds BF16 tensor cores with FP32 accumulation; the
tensor scales' product alpha is applied once in the epilogue. That is formats.gemm.emulated_mm,
and it agrees with formats.gemm.scaled_mm up to the order of the FP32 summation (tested with the
bound 2 K 2^-24 (|A| |B|^T) alpha). A NaN block scale makes its outputs NaN, as in the reference.
Under TRITON_INTERPRET=1 the dot takes the same exact values in fp32, because the interpreter's
dot multiplies bf16 operands' raw bit patterns.

Three ways to run it (``method``):
    fused      the kernel below: one pass, decode in the main loop. On an H100 it reaches only
               ~0.12 of cuBLAS BF16 (benchmarks/NOTES.md: the decode is ALU work the tensor
               cores wait for, and register operands defeat Hopper's smem-fed pipeline).
    two_stage  Triton decodes both operands to BF16 in memory (block_values: exact, no tensor
               scale), cuBLAS multiplies with FP32 output, alpha and the cast are two more passes.
    decoded    the same decode, then kernels.matmul.scaled_mm: alpha and the cast in the epilogue.
    auto       decoded on CUDA, fused elsewhere.
All compute formats.gemm.emulated_mm's function; they differ only in FP32 summation order.
``grouped_fp4_mm`` runs one GEMM per MoE expert (variable rows each) in one launch.

Operands as formats.gemm: A [M, K] and B [N, K], both quantized along K in the same format.

Public: ``fp4_mm``, ``grouped_fp4_mm``, ``GemmMethod``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..formats.gemm import _check_pair, gemm_alpha
from ..formats.layout import with_scale_layout
from ..formats.types import Format, FP4Tensor, ScaleLayout, Choice
from .decode import block_values
from .elements import e2m1_value, scale_value
from .host import cdiv
from .launch import cached
from .matmul import grouped_scaled_mm, scaled_mm


class GemmMethod(Choice):
    AUTO = "auto"
    """decoded on CUDA, fused elsewhere."""
    FUSED = "fused"
    """Decode packed codes in the GEMM's main loop."""
    TWO_STAGE = "two_stage"
    """Decode to BF16 in memory, then cuBLAS with FP32 output, then alpha."""
    DECODED = "decoded"
    """Decode to BF16 in memory, then kernels.matmul.scaled_mm (alpha and the cast in its epilogue)."""


@triton.jit
def _decode_tile(codes_ptr, scales_ptr, rows, k0, n_rows, KP, BLOCK: tl.constexpr, NVFP4: tl.constexpr,
                 ROWS: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr):
    """-> [ROWS, BK] bf16 (fp32 if DOT_F32) code * block scale for K columns k0 .. k0 + BK."""
    kb = k0 // 2 + tl.arange(0, BK // 2)
    live = rows[:, None] < n_rows
    packed = tl.load(codes_ptr + rows[:, None] * (KP // 2) + kb[None, :], mask=live & (kb[None, :] < KP // 2),
                     other=0).to(tl.int32)
    sb = k0 // BLOCK + tl.arange(0, BK // BLOCK)
    sbyte = tl.load(scales_ptr + rows[:, None] * (KP // BLOCK) + sb[None, :], mask=live & (sb[None, :] < KP // BLOCK),
                    other=0).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (ROWS, BK // BLOCK, BLOCK))
    values = e2m1_value(codes) * scale_value(sbyte, NVFP4)[:, :, None]
    values = tl.reshape(values, (ROWS, BK))
    return values if DOT_F32 else values.to(tl.bfloat16)


@cached  # (launched through kernels.launch)
@triton.jit
def _fp4_mm_kernel(a_codes, a_scales, b_codes, b_scales, a_tscale, b_tscale, c_ptr, M, N, KP,
                   BLOCK: tl.constexpr, NVFP4: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr):
    # grouped launch order: GROUP_M row tiles share each column tile while it sits in L2
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, KP, BK):
        a = _decode_tile(a_codes, a_scales, rm, k0, M, KP, BLOCK, NVFP4, BM, BK, DOT_F32)
        b = _decode_tile(b_codes, b_scales, rn, k0, N, KP, BLOCK, NVFP4, BN, BK, DOT_F32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee" if DOT_F32 else None)
    if NVFP4:
        acc = acc * (tl.load(a_tscale) * tl.load(b_tscale))  # alpha = S_dec_A * S_dec_B, once
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def fp4_mm(qa: FP4Tensor, qb: FP4Tensor, *, out_dtype: torch.dtype = torch.float32,
           method: str | GemmMethod = GemmMethod.AUTO) -> torch.Tensor:
    """qa: A [M, K], qb: B [N, K], quantized along K -> C = A @ B^T: [M, N] ``out_dtype``."""
    m, n = _check_pair(qa, qb)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"fp4_mm writes float32 or bfloat16, got {out_dtype}")
    method = GemmMethod.parse(method)
    if method is GemmMethod.DECODED or (method is GemmMethod.AUTO and qa.codes.is_cuda):
        a, b = block_values(qa, torch.bfloat16)[:m], block_values(qb, torch.bfloat16)[:n]
        return scaled_mm(a, b, gemm_alpha(qa, qb), out_dtype=out_dtype)
    if method is GemmMethod.TWO_STAGE:
        return _two_stage(qa, qb, m, n, out_dtype)
    qa, qb = with_scale_layout(qa, ScaleLayout.PLAIN), with_scale_layout(qb, ScaleLayout.PLAIN)
    kp, bl = qa.padded_len, qa.block_len
    out = torch.empty(m, n, dtype=out_dtype, device=qa.codes.device)
    if out.numel() == 0:
        return out
    if kp == 0:
        return out.zero_()
    nvfp4 = qa.format is Format.NVFP4
    bm, bn, bk = 128, 128, 64  # H100: 8 warps, 3 stages
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    dummy = qa.codes
    _fp4_mm_kernel[grid](qa.codes, qa.scales.view(torch.uint8), qb.codes, qb.scales.view(torch.uint8),
                         qa.tensor_scale if nvfp4 else dummy, qb.tensor_scale if nvfp4 else dummy, out,
                         m, n, kp, BLOCK=bl, NVFP4=nvfp4, BM=bm, BN=bn, BK=bk, GROUP_M=8,
                         DOT_F32=os.environ.get("TRITON_INTERPRET") == "1", num_warps=8, num_stages=3)
    return out


def _two_stage(qa: FP4Tensor, qb: FP4Tensor, m: int, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    a = block_values(qa, torch.bfloat16)[:m]  # [M, Kp] exact
    b = block_values(qb, torch.bfloat16)[:n]
    if a.is_cuda:
        acc = torch.mm(a, b.T, out_dtype=torch.float32)
    else:  # the interpreter: the same exact values, an fp32 matmul
        acc = a.float() @ b.float().T
    return (acc * gemm_alpha(qa, qb)).to(out_dtype)


def grouped_fp4_mm(qa: Sequence[FP4Tensor], qb: Sequence[FP4Tensor], *,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One GEMM per group in one launch (MoE experts): qa[g]: A_g [m_g, K], qb[g]: B_g [N, K], all
    quantized along K in one format -> [sum m_g, N], rows of group g = A_g @ B_g^T (fp4_mm's
    function; each group keeps its own tensor scales). Operands are decoded to BF16 into one
    buffer each, then kernels.matmul.grouped_scaled_mm."""
    if len(qa) != len(qb) or not qa:
        raise ValueError(f"grouped_fp4_mm takes as many A as B operands (at least one), got {len(qa)} and {len(qb)}")
    shapes = [_check_pair(a, b) for a, b in zip(qa, qb)]
    if len({(b.padded_len, n) for b, (_, n) in zip(qb, shapes)}) != 1 or len({a.padded_len for a in qa}) != 1:
        raise ValueError("grouped_fp4_mm: every group must share K and N")
    sizes = [m for m, _ in shapes]
    n, kp = shapes[0][1], qa[0].padded_len
    device = qa[0].codes.device
    a = torch.empty(sum(sizes), kp, dtype=torch.bfloat16, device=device)
    b = torch.empty(len(qb), n, kp, dtype=torch.bfloat16, device=device)
    start = 0
    for g, (qa_g, qb_g) in enumerate(zip(qa, qb)):
        _decode_rows(qa_g, a[start:start + sizes[g]])
        _decode_rows(qb_g, b[g])
        start += sizes[g]
    alpha = torch.stack([gemm_alpha(qa_g, qb_g) for qa_g, qb_g in zip(qa, qb)])
    return grouped_scaled_mm(a, b, sizes, alpha, out_dtype=out_dtype)


def _decode_rows(q: FP4Tensor, out: torch.Tensor) -> None:
    """The first out.shape[0] rows of q's block values into ``out`` [rows, Kp] (contiguous)."""
    if q.lead_shape.numel() == out.shape[0]:  # no padding rows: decode in place
        block_values(q, out=out.view(*q.lead_shape, out.shape[-1]))
    elif out.shape[0]:
        out.copy_(block_values(q).reshape(-1, out.shape[-1])[: out.shape[0]])
