"""Scaled BF16 GEMMs on tensor cores with alpha in the epilogue: dense and grouped (MoE).

An emulated FP4 GEMM multiplies *block values* (code * block scale, exact in BF16) and applies
alpha = S_dec_A * S_dec_B once to the FP32 accumulator. cuBLAS can do the product but not a
device-resident alpha, which costs two extra passes over an FP32 output (write, scale, cast);
this kernel does all of it in one: C = round_bf16(alpha * (A @ B^T)) with FP32 accumulation.

    scaled_mm(a, b, alpha)                    a: [M, K], b: [N, K] (any strides) -> [M, N]; alpha
                                              one tensor, or the pair (S_dec_A, S_dec_B) multiplied
                                              in the epilogue (no launch for the product), or None
    grouped_scaled_mm(a, b, sizes, alpha)     a: [S, K] rows of G groups, back to back (sizes[g]
                                              rows each), b: [G, N, K] -> [S, N]; group g's rows
                                              times b[g]^T, scaled by alpha[g] (one launch)
    contraction_grouped_mm(a, b, widths, alpha)
                                              a: [M, S], b: [N, S], S split into G groups of
                                              widths[g] columns -> [G, M, N]: group g's columns
                                              of a times those of b, transposed, scaled by alpha[g]
                                              (one launch: MoE wgrad, contracting each expert's
                                              own tokens)

The grouped launch walks a tile list: tile t covers rows tile_row[t] .. + BM of group
tile_group[t], masked at the group's end. Given ``sizes`` as a list of ints, the list is made on
the host, one tile per BM rows of each group, and groups of 0 rows cost nothing. Given them as a
tensor on the operands' device (a routing's counts), it is made there, with no host sync, so a
CUDA graph can capture the launch: sized for the most tiles any split of the rows can need,
the tiles past the live ones get an empty row range and their programs do no work.
``contraction_grouped_mm`` takes its widths either way too.

On CUDA a dense call whose operands cuBLASLt can read runs there (kernels.blas: the same function
with alpha read on the device, at cuBLAS's speed; ``CUBLASLT = False`` keeps the Triton kernels).
Elsewhere, and for every grouped call, the Triton kernels below. On CUDA their tiles come
through TMA descriptors (``_scaled_mm_tma_kernel``) where the operands' layout allows, else
through pointers (``_scaled_mm_kernel``, also the interpreter's path).
A traced call (kernels.launch: a host descriptor cannot be recorded) takes the persistent kernel
with descriptors it makes on the device, where each operand starts 16-byte aligned in its
allocation (fp4lab's own outputs, and Inductor aligns its buffers), else the pointer kernel.
Under TRITON_INTERPRET=1 the dot multiplies exact fp32 copies (the interpreter's bf16 dot
multiplies raw bit patterns); the result is the same function up to fp32 summation order.

Public: ``scaled_mm``, ``grouped_scaled_mm``, ``contraction_grouped_mm``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import blas, groups
from .elements import to_bf16_rtne, widen
from .host import PlanTable, cdiv, env, sm_count, starts_aligned, tracing
from .launch import cached
from .operand import device_counts

# tiles for H100/H200 (benchmarks/NOTES.md: a sweep at 8192^3): 256 x 128 x 64, 8 warps, 4 stages
_BM, _BN, _BK, _WARPS, _STAGES = 256, 128, 64, 8, 4
# the wgrad launch's outputs are small (moe64: 64 x [256, 512]) and its contractions short: 128 x 128,
# 8 warps, 3 stages ran 4x faster than the dense tile (benchmarks/sweep_wgrad.py); BK stays _BK, so
# each element is summed in the dense kernel's order (the same bits, checked in the sweep)
_WGRAD_BM, _WGRAD_BN, _WGRAD_WARPS, _WGRAD_STAGES = 128, 128, 8, 3
# dense launches, by output size (benchmarks/sweep_gemm.py at d12's fifteen GEMM shapes on an H100;
# BK stays _BK in all, so every one gives the same bits):
# - a large output (as many 256 x 128 tiles as SMs), through TMA: the persistent kernel on 128 x 256
#   tiles (fprop at K = 768: 1.32x -> 1.22x cuBLAS); through pointers, the default tile
# - a weight gradient's small output over a long contraction (d12's [2304, 768] is 54 tiles of
#   256 x 128 on 132 SMs): 128 x 128 tiles, 1.1-1.2x cuBLAS instead of 1.7-4x
# - fewer 128 x 128 tiles than half the SMs ([768, 768]: 36): 64 x 128, 4 warps (2.1x -> 1.8x)
_LARGE_OUT = (128, 256, 64, 8, 4)
_SMALL_OUT = (128, 128, 64, 8, 4)
_TINY_OUT = (64, 128, 64, 4, 4)
USE_TMA = True
"""On CUDA, read tiles through TMA descriptors where the operands allow (16-byte aligned rows, one
contiguous axis); False forces the pointer kernel (benchmarks compare the two)."""
_SHARED_BYTES = 232448  # shared memory a program may take on sm_90 (227 KB)
CUBLASLT = True
"""On CUDA, dense GEMMs whose operands allow it run on cuBLASLt (kernels.blas: its BF16 GEMM with
alpha read on the device, faster than the Triton kernels at every shape measured); False keeps
them on the Triton kernels (the sweeps of those, and the tests of their bits)."""
PERSISTENT = True
"""Dense TMA launches as the persistent kernel (one program an SM walking the output tiles);
False: one program a tile, the default tile at large outputs (benchmarks compare the two; the
same bits)."""


@triton.jit
def _dense_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (group 0, first row, row end M, column tile): GROUP_M row tiles share each column
    tile while it sits in L2."""
    tiles_n = tl.cdiv(N, BN)
    tiles_m = tl.cdiv(M, BM)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    row0 = (first_m + (pid % (GROUP_M * tiles_n)) % size_m) * BM
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    return 0, row0, M, pid_n


@triton.jit
def _grouped_tile(pid, tile_group_ptr, tile_row_ptr, group_end_ptr, N, BN: tl.constexpr):
    """Program -> (group, first row, the group's row end, column tile) from the host's tile list.
    (Apart from _dense_tile: where a dense kernel handed these pointers on, torch's analysis of a
    traced launch would count them written, since the stored addresses come from the call.)"""
    tiles_n = tl.cdiv(N, BN)
    t, pid_n = pid // tiles_n, pid % tiles_n
    g = tl.load(tile_group_ptr + t)
    return g, tl.load(tile_row_ptr + t), tl.load(group_end_ptr + g), pid_n


@triton.jit
def _store_scaled(acc, alpha_ptr, beta_ptr, g, s_alpha, c_ptr, rm, rn, row_end, N, s_cm, s_cn,
                  BF16_OUT: tl.constexpr, ALPHA: tl.constexpr):
    """The epilogue: acc * alpha[g] (ALPHA 1), acc * (alpha * beta) (ALPHA 2: a dense GEMM's two
    tensor scales, multiplied here in fp32 as a separate multiply would), or acc (ALPHA 0: no
    scale); cast (bf16 round to nearest even), stored where rows and columns are inside the group
    and the matrix."""
    if ALPHA == 2:
        acc = acc * (tl.load(alpha_ptr) * tl.load(beta_ptr))
    elif ALPHA == 1:
        acc = acc * tl.load(alpha_ptr + g * s_alpha)
    c = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn.to(tl.int64)[None, :] * s_cn
    live = (rm[:, None] < row_end) & (rn[None, :] < N)
    if BF16_OUT:
        tl.store(c, to_bf16_rtne(acc), mask=live)
    else:
        tl.store(c, acc, mask=live)


@triton.jit
def _accumulate(a_ptr, b_ptr, rm_in, rn_in, s_am, s_ak, s_bn, s_bk, K, EVEN_K: tl.constexpr,
                DOT_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """-> fp32 [BM, BN] sum over k < K of A[rm, k] * B[rn, k], BK columns at a time from k = 0
    (clamped rows and columns: the caller never stores them)."""
    rk = tl.arange(0, BK)
    a_tile = a_ptr + rm_in[:, None] * s_am + rk[None, :] * s_ak
    b_tile = b_ptr + rn_in[None, :] * s_bn + rk[:, None] * s_bk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a, b = tl.load(a_tile), tl.load(b_tile)
        else:
            a = tl.load(a_tile, mask=(k0 + rk)[None, :] < K, other=0.0)
            b = tl.load(b_tile, mask=(k0 + rk)[:, None] < K, other=0.0)
        if DOT_F32:
            a = widen(a.to(tl.int16, bitcast=True), True)
            b = widen(b.to(tl.int16, bitcast=True), True)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_tile += BK * s_ak
        b_tile += BK * s_bk
    return acc


@cached  # (launched through kernels.launch)
@triton.jit
def _scaled_mm_kernel(a_ptr, b_ptr, c_ptr, alpha_ptr, beta_ptr, tile_group_ptr, tile_row_ptr, group_end_ptr,
                      M, N, K, s_am, s_ak, s_bg, s_bn, s_bk, s_cm, s_cn, s_alpha,
                      GROUPED: tl.constexpr, BF16_OUT: tl.constexpr, EVEN_K: tl.constexpr,
                      DOT_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, ALPHA: tl.constexpr):
    if GROUPED:
        g, row0, row_end, pid_n = _grouped_tile(tl.program_id(0), tile_group_ptr, tile_row_ptr, group_end_ptr, N, BN)
    else:
        g, row0, row_end, pid_n = _dense_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    if GROUPED:
        b_ptr += g.to(tl.int64) * s_bg
        K = tl.where(row0 < row_end, K, 0)  # a tile past a device-made list's live ones: no work
    rm = row0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    # rows and columns past the end read a valid one (clamped) and are never stored: no load masks
    rm_in = tl.minimum(rm, row_end - 1).to(tl.int64)
    rn_in = tl.minimum(rn, N - 1).to(tl.int64)
    acc = _accumulate(a_ptr, b_ptr, rm_in, rn_in, s_am, s_ak, s_bn, s_bk, K, EVEN_K, DOT_F32, BM, BN, BK)
    _store_scaled(acc, alpha_ptr, beta_ptr, g, s_alpha, c_ptr, rm, rn, row_end, N, s_cm, s_cn, BF16_OUT, ALPHA)


@cached  # (launched through kernels.launch)
@triton.jit
def _contraction_grouped_kernel(a_ptr, b_ptr, c_ptr, alpha_ptr, k_start_ptr, k_width_ptr, M, N,
                                s_am, s_ak, s_bn, s_bk, s_cg, s_cm, s_cn,
                                BF16_OUT: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                                K_MULTIPLE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C[g] = alpha[g] * (A[:, seg_g] @ B[:, seg_g]^T), seg_g = the group's columns: each program
    one (group, row tile, column tile), its contraction the group's own columns, summed in the
    order _scaled_mm_kernel sums a [M, width] x [N, width] product (the same _accumulate)."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    pid = tl.program_id(0)
    g, t = pid // (tiles_m * tiles_n), pid % (tiles_m * tiles_n)
    rm = (t // tiles_n) * BM + tl.arange(0, BM)
    rn = (t % tiles_n) * BN + tl.arange(0, BN)
    rm_in = tl.minimum(rm, M - 1).to(tl.int64)
    rn_in = tl.minimum(rn, N - 1).to(tl.int64)
    k0 = tl.load(k_start_ptr + g).to(tl.int64)
    width = tl.load(k_width_ptr + g)
    if K_MULTIPLE > 1:  # the launcher's promise: starts and widths multiples of K_MULTIPLE
        k0 = tl.multiple_of(k0, K_MULTIPLE)
        width = tl.multiple_of(width, K_MULTIPLE)
    acc = _accumulate(a_ptr + k0 * s_ak, b_ptr + k0 * s_bk, rm_in, rn_in, s_am, s_ak, s_bn, s_bk,
                      width, EVEN_K, DOT_F32, BM, BN, BK)
    # alpha[g] as the epilogue applies it; a group of width 0 gives zeros, as scaled_mm at K = 0
    # (not alpha * 0: an empty group's alpha may be inf), written here rather than filled after
    acc = acc * tl.where(width > 0, tl.load(alpha_ptr + g), 0.0)
    _store_scaled(acc, alpha_ptr, alpha_ptr, g, 1, c_ptr + g.to(tl.int64) * s_cg, rm, rn, M, N, s_cm, s_cn, BF16_OUT,
                  0)


@cached  # (launched through kernels.launch)
@triton.jit
def _scaled_mm_tma_kernel(a_desc, b_desc, c_ptr, alpha_ptr, beta_ptr, tile_group_ptr, tile_row_ptr, group_end_ptr,
                          M, N, K, s_cm, s_cn, s_alpha, b_group_rows,
                          GROUPED: tl.constexpr, B_KN: tl.constexpr, BF16_OUT: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          ALPHA: tl.constexpr):
    """The same GEMM with tiles brought in by Hopper's tensor memory accelerator (TMA descriptors:
    out-of-range reads are zeros). b is [G * b_group_rows, K] (K-major: group g's B from row
    g * b_group_rows) or, with B_KN, [G * b_group_rows, N] (group g's B^T from that row). Grouped:
    rows past a group's end read the next group's rows; they are never stored."""
    if GROUPED:
        g, row0, row_end, pid_n = _grouped_tile(tl.program_id(0), tile_group_ptr, tile_row_ptr, group_end_ptr, N, BN)
    else:
        g, row0, row_end, pid_n = _dense_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    b_row0 = g * b_group_rows
    n0 = pid_n * BN
    if GROUPED:
        K = tl.where(row0 < row_end, K, 0)  # a tile past a device-made list's live ones: no work
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = a_desc.load([row0, k0])
        if B_KN:
            acc = tl.dot(a, b_desc.load([b_row0 + k0, n0]), acc)
        else:
            acc = tl.dot(a, b_desc.load([b_row0 + n0, k0]).T, acc)
    _store_scaled(acc, alpha_ptr, beta_ptr, g, s_alpha, c_ptr, row0 + tl.arange(0, BM), n0 + tl.arange(0, BN),
                  row_end, N, s_cm, s_cn, BF16_OUT, ALPHA)


@cached  # (launched through kernels.launch)
@triton.jit
def _scaled_mm_persistent_kernel(a_desc, b_desc, c_ptr, alpha_ptr, beta_ptr, M, N, K, s_cm, s_cn, programs, s_a, s_b,
                                 B_KN: tl.constexpr, BF16_OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                 BK: tl.constexpr, GROUP_M: tl.constexpr, ALPHA: tl.constexpr,
                                 DEVICE_DESC: tl.constexpr = False):
    """The dense TMA GEMM as a persistent kernel: ``programs`` programs (one an SM, at most one a
    tile; a run-time number, so a new output size does not compile again) walk the output
    tiles in _dense_tile's order, one K loop after another flattened into a single pipelined loop, so
    the loads of a program's next tile are in flight while it scales and stores the last (a short
    contraction, K = 768, spends a third of a tile's time outside its K loop). Each output element
    is summed as _scaled_mm_tma_kernel sums it (the same K steps): the same bits. With DEVICE_DESC
    (a traced launch, whose host descriptors torch cannot record: kernels.launch) a_desc and b_desc
    are the matrices' base pointers, their rows s_a and s_b elements apart, and the kernel makes the
    same descriptors itself (the tiles, and zeros past the edges, as the host's)."""
    if DEVICE_DESC:
        a_desc = tl.make_tensor_descriptor(a_desc, shape=[M, K], strides=[s_a, 1], block_shape=[BM, BK])
        if B_KN:
            b_desc = tl.make_tensor_descriptor(b_desc, shape=[K, N], strides=[s_b, 1], block_shape=[BK, BN])
        else:
            b_desc = tl.make_tensor_descriptor(b_desc, shape=[N, K], strides=[s_b, 1], block_shape=[BN, BK])
    tiles_n = tl.cdiv(N, BN)
    tiles = tl.cdiv(M, BM) * tiles_n
    k_steps = tl.cdiv(K, BK)
    tile = tl.program_id(0) - programs
    row0, n0 = 0, 0
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # one flattened loop over (this program's tiles) x (K steps): ki counts K steps within a tile
    ki = -1
    steps = tl.cdiv(tiles - tl.program_id(0), programs) * k_steps
    for _ in tl.range(0, steps, flatten=True):
        ki = tl.where(ki == k_steps - 1, 0, ki + 1)
        if ki == 0:
            tile += programs
            _, row0, _, pid_n = _dense_tile(tile, M, N, BM, BN, GROUP_M)
            n0 = pid_n * BN
        a = a_desc.load([row0, ki * BK])
        if B_KN:
            acc = tl.dot(a, b_desc.load([ki * BK, n0]), acc)
        else:
            acc = tl.dot(a, b_desc.load([n0, ki * BK]).T, acc)
        if ki == k_steps - 1:
            _store_scaled(acc, alpha_ptr, beta_ptr, 0, 0, c_ptr, row0 + tl.arange(0, BM), n0 + tl.arange(0, BN), M,
                          N, s_cm, s_cn, BF16_OUT, ALPHA)
            acc = tl.zeros((BM, BN), dtype=tl.float32)


def _descriptors(a: torch.Tensor, b: torch.Tensor, bm: int, bn: int, bk: int):
    """TMA descriptors of a grouped launch, for a [S, K] and b [G, N, K] (either of b's last two
    axes contiguous) -> (a_desc, b_desc, b stored [K, N], rows per group in b's 2D view), or None
    where TMA cannot read them: rows not 16-byte aligned, no contiguous axis, or (N-major) a K
    that the tiles would overrun into the next group's rows. (A dense launch's: _DensePlan.)"""
    descriptor = _tma_descriptor()
    if descriptor is None or not _tma_reads_rows(a) or a.data_ptr() % 16:
        return None
    k, n = a.shape[1], b.shape[-2]
    if b.stride(2) == 1:  # K-major: a [G * rows, K] view
        kn, step, block = False, b.stride(1), [bn, bk]
        width = k
    elif b.stride(1) == 1 and k % bk == 0:  # N-major: a [G * rows, N] view
        kn, step, block = True, b.stride(2), [bk, bn]
        width = n
    else:
        return None
    needed = k if kn else n  # rows of the 2D view that one group's B spans
    if b.shape[0] > 1 and (b.stride(0) % step or b.stride(0) < needed * step):  # expanded or overlapping
        return None
    rows = b.stride(0) // step if b.shape[0] > 1 else needed
    b_mat = b.as_strided((b.shape[0] * rows, width), (step, 1))
    if (step * 2) % 16 or b_mat.data_ptr() % 16:
        return None
    return descriptor.from_tensor(a, [bm, bk]), descriptor.from_tensor(b_mat, block), kn, rows


def _check(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *alphas: torch.Tensor) -> None:
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"scaled_mm takes bfloat16 operands, got {a.dtype} and {b.dtype}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"scaled_mm writes float32 or bfloat16, got {out_dtype}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"K mismatch: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if b.device != a.device:
        raise ValueError(f"scaled_mm takes both operands on one device, got {a.device} and {b.device}")
    for alpha in alphas:
        if alpha.dtype != torch.float32 or alpha.device != a.device:
            raise TypeError(f"alpha must be a float32 tensor on {a.device}, got {alpha.dtype} on {alpha.device}")


def _tile_shape() -> tuple[int, int, int]:
    """(BM, BN, BK): small tiles under the interpreter, the H100 sweep's otherwise."""
    return (32, 32, 32) if env("TRITON_INTERPRET") == "1" else (_BM, _BN, _BK)


def _output(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The output buffer, and whether it is already the answer (no elements, or zeros when K is 0)."""
    out = torch.empty(rows, n, dtype=dtype, device=device)
    if out.numel() and k == 0:
        out.zero_()
    return out, out.numel() == 0 or k == 0


def _config(m: int, n: int, grouped: bool, device: torch.device, persistent: bool = False
            ) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, stages) of a launch: grouped launches keep _tile_shape's (their tile
    lists are made for it), and so does the interpreter; a dense one takes its output size's
    (the table above), the persistent kernel's at a large output."""
    if grouped or env("TRITON_INTERPRET") == "1":
        return (*_tile_shape(), _WARPS, _STAGES)
    sms = sm_count(device)
    if cdiv(m, _BM) * cdiv(n, _BN) >= sms:
        return _LARGE_OUT if persistent else (_BM, _BN, _BK, _WARPS, _STAGES)
    return _TINY_OUT if 2 * cdiv(m, 128) * cdiv(n, 128) < sms else _SMALL_OUT


def _grouped_launch(a, b, out, alpha, s_alpha, tiles, m, n, k):
    """One grouped GEMM launch (grouped_scaled_mm): the TMA kernel where _descriptors can read the
    operands, else the pointer kernel, walking the tile list ``tiles``; group g's epilogue scales
    by alpha[g * s_alpha]."""
    interpreted = env("TRITON_INTERPRET") == "1"
    bm, bn, bk, warps, stages = _config(m, n, True, a.device)
    grid = (tiles[0].numel() * cdiv(n, bn),)
    bf16 = out.dtype == torch.bfloat16
    tma = None if interpreted or not USE_TMA else _descriptors(a, b, bm, bn, bk)
    if tma is not None:
        a_desc, b_desc, kn, group_rows = tma
        _scaled_mm_tma_kernel[grid](a_desc, b_desc, out, alpha, alpha, *tiles, m, n, k, out.stride(0), out.stride(1),
                                    s_alpha, group_rows, GROUPED=True, B_KN=kn, BF16_OUT=bf16, BM=bm, BN=bn, BK=bk,
                                    GROUP_M=8, ALPHA=1, num_warps=warps, num_stages=stages)
        return
    _scaled_mm_kernel[grid](a, b, out, alpha, alpha, *tiles, m, n, k, a.stride(0), a.stride(1), b.stride(0),
                            b.stride(-2), b.stride(-1), out.stride(0), out.stride(1), s_alpha, GROUPED=True,
                            BF16_OUT=bf16, EVEN_K=k % bk == 0, DOT_F32=interpreted, BM=bm, BN=bn, BK=bk, GROUP_M=8,
                            ALPHA=1, num_warps=warps, num_stages=stages)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None, *,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a: [M, K] bf16, b: [N, K] bf16 (any strides), alpha: [] fp32 -> alpha * (a @ b^T): [M, N].
    ``alpha`` may also be two [] fp32 tensors (S_dec_A, S_dec_B), multiplied as ``S_dec_A *
    S_dec_B`` would be (the Triton kernels in their epilogue, with no launch for the product;
    cuBLASLt takes one alpha, so that path launches the product: callers that can, pass the
    product a quantize pass wrote, BlockValues.alpha_with), or None: 1."""
    pair = alpha if isinstance(alpha, tuple) else (alpha,) if alpha is not None else ()
    if isinstance(alpha, tuple) and len(alpha) != 2:
        raise ValueError(f"scaled_mm takes alpha as one tensor, a pair (S_dec_A, S_dec_B) or None, got {len(alpha)}")
    plan = dense_plan(a, b, out_dtype, pair)
    if plan is None:
        (m, k), n = a.shape, b.shape[0]
        return _output(m, n, k, out_dtype, a.device)[0]
    m, n, _ = plan.mnk
    if plan.lt is not None and (out := plan.lt.run(a, b, pair)) is not None:
        return out
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    plan.launch(a, b, out, pair[0] if pair else out, pair[-1] if pair else out)  # (out: an unused pointer)
    return out


def dense_plan(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, alphas: tuple[torch.Tensor, ...]
               ) -> _DensePlan | None:
    """scaled_mm's checks of a call, then its plan (kept per call shape); None where the product
    has no elements. ``alphas``: none, one or two [] fp32 tensors."""
    _check(a, b, out_dtype, *alphas)
    if any(v.numel() != 1 for v in alphas):
        raise ValueError(f"scaled_mm takes one-element alphas, got shapes {[tuple(v.shape) for v in alphas]}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"scaled_mm takes 2D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    (m, k), n = a.shape, b.shape[0]
    if not m * n * k:
        return None
    # (the tile settings a plan was made under are part of its key: a sweep that changes them, or
    # _config itself, gets plans of the new tile)
    key = (a.shape, a.stride(), b.shape, b.stride(), out_dtype, len(alphas), a.device, USE_TMA, PERSISTENT, CUBLASLT,
           _config, _BM, _BN, _BK, _WARPS, _STAGES, _LARGE_OUT, _SMALL_OUT, _TINY_OUT)
    plan = _DENSE_PLANS.get(key)
    if plan is None:
        plan = _DENSE_PLANS.keep(key, _DensePlan(a, b, out_dtype, len(alphas)))
    return plan


class _DensePlan:
    """What a dense scaled_mm launch takes from its operands' shapes, strides and dtypes (tensors
    aside): the kernel (the persistent TMA kernel, the TMA kernel or the pointer kernel; module
    doc), tile and stages, worked out once per such call (an FP4 linear makes the same three every
    step) and kept. Where the layout allows TMA, a call whose operands are not 16-byte aligned
    takes the pointer kernel on its own tile. Whether the interpreter runs is read when a plan is
    made: Triton decides it when the kernels are decorated, at import."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, mode: int) -> None:
        (m, k), n = a.shape, b.shape[0]
        self.mnk = m, n, k
        interpreted = env("TRITON_INTERPRET") == "1"
        self.lt = blas.plan(a, b, out_dtype) if CUBLASLT and not interpreted else None
        bm, bn, bk, warps, stages = _config(m, n, False, a.device)
        kw = dict(BF16_OUT=out_dtype == torch.bfloat16, GROUP_M=8, ALPHA=mode)
        self.pointer = _scaled_mm_kernel.bind(GROUPED=False, EVEN_K=k % bk == 0, DOT_F32=interpreted, BM=bm, BN=bn,
                                              BK=bk, num_warps=warps, num_stages=stages, **kw)
        self.pointer_grid = (cdiv(m, bm) * cdiv(n, bn),)
        # TMA: a row-major a, and b K-major ([N, K] rows) or N-major (read as b^T [K, N] rows)
        self.tma = None
        if interpreted or not USE_TMA or not _tma_reads_rows(a):
            return
        if b.stride(1) == 1:
            self.b_kn, step = False, b.stride(0)
        elif b.stride(0) == 1:
            self.b_kn, step = True, b.stride(1)
        else:
            return
        if (step * 2) % 16 or _tma_descriptor() is None:
            return
        if PERSISTENT:
            bm, bn, bk, warps, stages = _config(m, n, False, a.device, persistent=True)
            programs = min(sm_count(a.device), cdiv(m, bm) * cdiv(n, bn))
            # the epilogue's staging tile stays allocated beside the pipeline's buffers (the next
            # tile's loads are in flight): as many stages as fit beside it in an SM's shared memory
            epilogue = bm * bn * (2 if out_dtype == torch.bfloat16 else 4)
            stages = max(1, min(stages, (_SHARED_BYTES - epilogue) // ((bm + bn) * bk * a.element_size())))
            self.tma = _scaled_mm_persistent_kernel.bind(B_KN=self.b_kn, BM=bm, BN=bn, BK=bk, num_warps=warps,
                                                          num_stages=stages, **kw)
            self.traced = _scaled_mm_persistent_kernel.bind(B_KN=self.b_kn, BM=bm, BN=bn, BK=bk, num_warps=warps,
                                                             num_stages=stages, DEVICE_DESC=True, **kw)
            self.tma_grid = (programs,)  # (the kernel takes its program count too)
        else:
            self.tma = _scaled_mm_tma_kernel.bind(GROUPED=False, B_KN=self.b_kn, BM=bm, BN=bn, BK=bk, num_warps=warps,
                                                   num_stages=stages, **kw)
            self.tma_grid = self.pointer_grid  # (the same tile)
        self.persistent = PERSISTENT
        self.blocks = [bm, bk], ([bk, bn] if self.b_kn else [bn, bk])

    def launch(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alpha: torch.Tensor,
               beta: torch.Tensor) -> None:
        m, n, k = self.mnk
        if self.tma is not None and tracing():
            # no address to read, and a host descriptor cannot be recorded (kernels.launch): the
            # persistent kernel makes its descriptors itself, where the operands start 16-byte
            # aligned in their allocations (which Inductor aligns); else the pointer kernel
            if self.persistent and starts_aligned(a) and starts_aligned(b):
                self._persistent(self.traced, a, b, a, b, out, alpha, beta)
                return
        elif self.tma is not None and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0:
            descriptor = _tma_descriptor()
            a_desc = descriptor.from_tensor(a, self.blocks[0])
            b_desc = descriptor.from_tensor(b.t() if self.b_kn else b, self.blocks[1])
            if self.persistent:
                self._persistent(self.tma, a_desc, b_desc, a, b, out, alpha, beta)
            else:
                self.tma[self.tma_grid](a_desc, b_desc, out, alpha, beta, a, a, a, m, n, k, out.stride(0),
                                        out.stride(1), 0, 0)
            return
        self.pointer[self.pointer_grid](a, b, out, alpha, beta, a, a, a, m, n, k, a.stride(0), a.stride(1), 0,
                                        b.stride(-2), b.stride(-1), out.stride(0), out.stride(1), 0)

    def _persistent(self, kernel, a_arg, b_arg, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                    alpha: torch.Tensor, beta: torch.Tensor) -> None:
        """One launch of the persistent GEMM (bound ``kernel``, host- or device-descriptor form),
        whose operands are ``a_arg`` and ``b_arg``: host descriptors, or the matrices themselves."""
        m, n, k = self.mnk
        kernel[self.tma_grid](a_arg, b_arg, out, alpha, beta, m, n, k, out.stride(0), out.stride(1),
                              self.tma_grid[0], a.stride(0), b.stride(1 if self.b_kn else 0))


_DENSE_PLANS = PlanTable(512)  # key -> _DensePlan


def _tma_reads_rows(a: torch.Tensor) -> bool:
    """Whether TMA can read a bf16 [rows, K] operand's layout: on CUDA, rows contiguous, each row's
    start 16-byte aligned from the first (the base address is checked at each call)."""
    return a.is_cuda and a.stride(1) == 1 and (a.stride(0) * 2) % 16 == 0


@functools.cache
def _tma_descriptor():
    """Triton's host TMA descriptor class, or None where this Triton has none."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def _host_tiles(sizes: list[int], bm: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(tile_group, tile_row, group_end) for the groups' rows, one tile per bm rows of each group."""
    tile_group, tile_row, ends, start = [], [], [], 0
    for g, size in enumerate(sizes):
        rows = range(start, start + size, bm)
        tile_group += [g] * len(rows)
        tile_row += list(rows)
        start += size
        ends.append(start)
    tiles = torch.tensor([tile_group, tile_row], dtype=torch.int32).to(device, non_blocking=True)
    return tiles[0], tiles[1], torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True)


def _counts(sizes, groups: int | None, device: torch.device, what: str) -> list[int] | torch.Tensor:
    """A list of ints (from any iterable, a CPU tensor with device operands included), or an
    integer tensor of ``groups`` entries (any number if None) on the operands' device, kept there."""
    if not isinstance(sizes, torch.Tensor) or (sizes.device.type == "cpu" and device.type != "cpu"):
        return [int(v) for v in sizes]
    return device_counts(sizes, groups, device, what)


def grouped_scaled_mm(a: torch.Tensor, b: torch.Tensor, sizes: Sequence[int] | torch.Tensor, alpha: torch.Tensor, *,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a: [S, K] bf16 (groups' rows back to back), b: [G, N, K] bf16, sizes: G ints summing to S,
    alpha: [G] (or []) fp32 -> [S, N]: rows of group g are alpha[g] * (a_g @ b[g]^T). Sizes given
    as a tensor on a's device are not read on the host, so they are trusted: negative ones count
    as 0, reads stop at S, and where they sum to less than S the rows past their sum are left
    unwritten."""
    _check(a, b, out_dtype, alpha)
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"grouped_scaled_mm takes a [S, K] and b [G, N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    sizes = _counts(sizes, b.shape[0], a.device, "sizes")
    if isinstance(sizes, list) and (len(sizes) != b.shape[0] or sum(sizes) != a.shape[0] or min(sizes, default=0) < 0):
        raise ValueError(f"grouped_scaled_mm: a {tuple(a.shape)}, b {tuple(b.shape)} and sizes {sizes} do not "
                         "match (a: [S, K], b: [G, N, K], G sizes >= 0 summing to S)")
    if alpha.numel() not in (1, b.shape[0]):
        raise ValueError(f"alpha must hold 1 or {b.shape[0]} values, got {alpha.numel()}")
    (s, k), n = a.shape, b.shape[1]
    out, done = _output(s, n, k, out_dtype, a.device)
    if done:
        return out
    bm = _tile_shape()[0]  # the launch's row tile: the tile list is cut to it
    tiles = groups.tiles(sizes, s, bm) if isinstance(sizes, torch.Tensor) else _host_tiles(sizes, bm, a.device)
    s_alpha = 1 if alpha.numel() > 1 else 0
    alpha = alpha.reshape(-1).contiguous()
    _grouped_launch(a, b, out, alpha, s_alpha, tiles, s, n, k)
    return out


def contraction_grouped_mm(a: torch.Tensor, b: torch.Tensor, widths: Sequence[int] | torch.Tensor,
                           alpha: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                           width_multiple: int = 1) -> torch.Tensor:
    """a: [M, S] bf16, b: [N, S] bf16 (any strides), widths: G ints >= 0 summing to S (a list, or a
    tensor on a's device, trusted as grouped_scaled_mm's sizes: reads stop at S), alpha: [G] fp32 -> [G, M, N]:
    out[g] = alpha[g] * (a_g @ b_g^T), a_g and b_g group g's columns; each is what
    scaled_mm(a_g, b_g, alpha[g]) computes (a group of width 0 gives zeros, whatever alpha).
    ``width_multiple``: every width is a multiple of it (checked in a list, trusted on the device;
    with S too, for device widths, which the clamp at S must keep whole): the kernel then loads
    the masked last block of a group in 16-byte vectors (wgrad's per-expert padding to 32 tokens;
    with a mask it cannot prove whole, Triton loads one element at a time, 3-4x slower)."""
    _check(a, b, out_dtype, alpha)
    widths = _counts(widths, None, a.device, "widths")
    listed = isinstance(widths, list)
    if a.dim() != 2 or b.dim() != 2 or listed and (sum(widths) != a.shape[1] or min(widths, default=0) < 0):
        raise ValueError(f"contraction_grouped_mm: a {tuple(a.shape)}, b {tuple(b.shape)} and widths {widths} do not "
                         "match (a: [M, S], b: [N, S], widths >= 0 summing to S)")
    if alpha.numel() != len(widths):
        raise ValueError(f"alpha must hold {len(widths)} values, got {alpha.numel()}")
    (m, _), n = a.shape, b.shape[0]
    out = torch.empty(len(widths), m, n, dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    interpreted = env("TRITON_INTERPRET") == "1"
    bm, bn, bk = _tile_shape() if interpreted else (_WGRAD_BM, _WGRAD_BN, _BK)
    if listed:
        if any(w % width_multiple for w in widths):
            raise ValueError(f"contraction_grouped_mm: widths {widths} are not all multiples of {width_multiple}")
        starts = [0, *itertools.accumulate(widths)][:-1]
        segments = torch.tensor([starts, widths], dtype=torch.int32).to(a.device, non_blocking=True)
        even_k = all(w % bk == 0 for w in widths)
        width_multiple = math.gcd(bk, *widths)  # (bk for no widths, or all widths multiples of it)
    else:  # on the device, clamped to the columns as the tile list clamps rows
        segments = groups.segments(widths, a.shape[1])
        even_k = False  # unknown here; masks that are all true give the unmasked path's bits
    grid = (len(widths) * cdiv(m, bm) * cdiv(n, bn),)
    _contraction_grouped_kernel[grid](a, b, out, alpha.reshape(-1).contiguous(), segments[0], segments[1], m, n,
                                      a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
                                      out.stride(1), out.stride(2), BF16_OUT=out_dtype == torch.bfloat16,
                                      EVEN_K=even_k, DOT_F32=interpreted, K_MULTIPLE=math.gcd(bk, width_multiple),
                                      BM=bm, BN=bn, BK=bk, num_warps=_WGRAD_WARPS, num_stages=_WGRAD_STAGES)
    return out
