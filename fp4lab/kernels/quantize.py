"""Triton NVFP4 and MXFP4 quantization: one pass over x, byte-identical to fp4lab.formats.

One kernel serves both formats. Each program loads a [BR, BC] tile of x through two strides, so
quantizing along the last axis and along axis 0 of a 2D tensor (the transposed, "columnwise"
copy TE keeps for Wgrad) are the same kernel with the strides swapped; output is always written
in the stored layout (block axis last). Per tile: block amax, NaN and Inf kept (a block holding
one is poisoned; 16x16 tiles reduce over 16 rows too), the block scale by the format's rule
(SCALE_RULE below, formulas in formats/nvfp4.py and formats/mxfp4.py), scale the elements,
encode E2M1 (RTNE or stochastic with Philox bytes, one Philox call per 16 elements), pack
nibbles, store codes and scale bytes.
The tensor amax is a separate pass (amax.py) unless the caller supplies it; every program
derives the per-tensor scalars from it (_tensor_terms, formats.nvfp4.nvfp4_tensor_terms' fp32
operations one for one) and the first writes S_dec, so a call is two launches and no host sync.
A CUDA tensor ``global_amax`` is trusted (checking it would sync); a float is checked.

Bytes per element for NVFP4 with bf16 input: 2 read + 0.5 codes + 1/16 scale = 2.5625.

Groups (``grouped_block_values``): the tensors of an MoE projection's experts, rows back to back,
quantized along their rows in one launch (after one grouped amax pass): each row looks up its
group (from the groups' first rows) for that group's amax, S_dec and seed, and counts its
stochastic-rounding Philox groups from its row within the group, so every group's bytes are
what quantizing it alone gives.

Public: ``quantize_nvfp4``, ``quantize_mxfp4`` (same signatures as fp4lab.formats),
``nvfp4_block_values``, ``mxfp4_block_values`` (the same quantize written as exact bf16 block
values), ``block_values_pair`` (a linear's two copies of one tensor from one read; ``try_block_values_pair``
and ``pair_refusal`` for callers with a fallback),
``grouped_block_values`` and ``grouped_column_block_values`` (wgrad's operands: groups
along the block axis, each a whole number of column tiles, so a program's group is one scalar).
"""

from __future__ import annotations

import itertools
import math
import operator
import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats.blocks import check_input, seed_key
from ..formats.hadamard import TE_SIGNS, HadamardSigns
from ..formats.mxfp4 import MX_BLOCK
from ..formats.nvfp4 import _check_amax, _nvfp4_block, nvfp4_tensor_terms
from ..formats.types import Format, FP4Tensor, MXScaleMode, NVFP4Profile, Rounding
from . import groups
from .amax import finite_amax_bits, grouped_finite_amax
from .host import PlanTable, cdiv, tracing, zeroed_int32
from .launch import cached
from .operand import BlockValues, device_counts
from .elements import (e2m1_rtne, e2m1_rtne_value, e2m1_stochastic, e2m1_stochastic_value, e2m1_value, e4m3_rtne,
                       e4m3_value, finite_key, group_of, key_bits, pack_nibble_pairs, philox_bytes, round_to_bf16,
                       scale_value, widen)

# SCALE_RULE: how a block's scale is made (NVFP4 profiles, then MXFP4 scale modes)
NV_TE, NV_TORCHAO, NV_FOUR_SIX = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
MX_FLOOR, MX_CEIL, MX_EVEN, MX_RCEIL = tl.constexpr(3), tl.constexpr(4), tl.constexpr(5), tl.constexpr(6)
# the launcher passes the plain ints
NV_RULES = {NVFP4Profile.TE: NV_TE.value, NVFP4Profile.TORCHAO: NV_TORCHAO.value,
            NVFP4Profile.FOUR_OVER_SIX: NV_FOUR_SIX.value}
MX_RULES = {MXScaleMode.FLOOR: MX_FLOOR.value, MXScaleMode.CEIL: MX_CEIL.value, MXScaleMode.EVEN: MX_EVEN.value,
            MXScaleMode.RCEIL: MX_RCEIL.value}
# GROUPED: one tensor, or groups' tensors back to back along the rows (fprop / dgrad operands of
# MoE experts) or along the block axis (wgrad's, each group a whole number of column tiles)
NO_GROUPS, ROW_GROUPS, COL_GROUPS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# HADAMARD: no transform, or the block-sized transform (16 or 32 points) with formats.hadamard's sign rule
NO_ROTATION, SIGNS_NONE, SIGNS_TE, SIGNS_RANDOM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
HADAMARD_RULES = {HadamardSigns.NONE: SIGNS_NONE.value, HadamardSigns.TE: SIGNS_TE.value,
                  HadamardSigns.RANDOM: SIGNS_RANDOM.value}
TE_NEGATIVE = tl.constexpr(sum(1 << j for j, s in enumerate(TE_SIGNS) if s < 0))
FLT_MAX = tl.constexpr(3.4028234663852886e38)
INV_SQRT32 = tl.constexpr(struct.unpack("f", struct.pack("f", 1 / math.sqrt(32)))[0])  # fp32(1/sqrt(32)), exactly
# (BR, BC, warps) per read direction (benchmarks/sweep_quantize.py on an H100): rows of a row-major
# tile, or a transposed read (axis 0 of a contiguous matrix)
TILES = {"rows": (32, 128, 4), "transposed": (128, 32, 4)}
COL_GROUP_WIDTH = 32  # column tile of a launch grouped along the block axis: groups are multiples of it


@triton.jit
def _tensor_terms(amax, RULE: tl.constexpr):
    """amax: fp32 scalar -> (S_dec, block multiplier): formats.nvfp4.nvfp4_tensor_terms."""
    if RULE == NV_TE:
        s_enc = tl.minimum(tl.div_rn(2688.0, amax), FLT_MAX)
        s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
        return tl.div_rn(1.0, s_enc), s_enc * 0.1666666716337204  # fp32(1/6)
    if RULE == NV_FOUR_SIX:  # 6 * 256; each candidate folds its own 1/M
        s_enc = tl.minimum(tl.div_rn(1536.0, amax), FLT_MAX)
        s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
        return tl.div_rn(1.0, s_enc), s_enc
    s_dec = tl.div_rn(tl.where(amax == 0, 1.0, amax), 2688.0)
    return s_dec, tl.minimum(tl.div_rn(1.0, s_dec), FLT_MAX)


@triton.jit
def _halves(v, BR: tl.constexpr, NB: tl.constexpr, N: tl.constexpr):
    """[BR, NB, N] -> its even and odd positions along the last axis, [BR, NB, N // 2] each."""
    return tl.split(tl.reshape(v, (BR, NB, N // 2, 2)))


@triton.jit
def _butterfly16_parts(v, BR: tl.constexpr, NB: tl.constexpr):
    """v: [BR, NB, 16] -> each 16-run times H16 (unscaled), in formats.hadamard._butterfly's order,
    as its 16 positions (p0 .. p15, each [BR, NB, 1]).

    The run is taken apart by halving along the last axis, and the four stages pair p_i with
    p_(i+h) as plain elementwise adds. Splitting a trailing axis of size 2 stays inside a thread,
    so the stages move no data between threads (a reshape/permute formulation did, four times)."""
    e, o = _halves(v, BR, NB, 16)
    ee, eo = _halves(e, BR, NB, 8)
    oe, oo = _halves(o, BR, NB, 8)
    eee, eeo = _halves(ee, BR, NB, 4)
    eoe, eoo = _halves(eo, BR, NB, 4)
    oee, oeo = _halves(oe, BR, NB, 4)
    ooe, ooo = _halves(oo, BR, NB, 4)
    p0, p8 = _halves(eee, BR, NB, 2)
    p4, p12 = _halves(eeo, BR, NB, 2)
    p2, p10 = _halves(eoe, BR, NB, 2)
    p6, p14 = _halves(eoo, BR, NB, 2)
    p1, p9 = _halves(oee, BR, NB, 2)
    p5, p13 = _halves(oeo, BR, NB, 2)
    p3, p11 = _halves(ooe, BR, NB, 2)
    p7, p15 = _halves(ooo, BR, NB, 2)
    # h = 1: (0, 1), (2, 3), ...
    p0, p1 = p0 + p1, p0 - p1
    p2, p3 = p2 + p3, p2 - p3
    p4, p5 = p4 + p5, p4 - p5
    p6, p7 = p6 + p7, p6 - p7
    p8, p9 = p8 + p9, p8 - p9
    p10, p11 = p10 + p11, p10 - p11
    p12, p13 = p12 + p13, p12 - p13
    p14, p15 = p14 + p15, p14 - p15
    # h = 2
    p0, p2 = p0 + p2, p0 - p2
    p1, p3 = p1 + p3, p1 - p3
    p4, p6 = p4 + p6, p4 - p6
    p5, p7 = p5 + p7, p5 - p7
    p8, p10 = p8 + p10, p8 - p10
    p9, p11 = p9 + p11, p9 - p11
    p12, p14 = p12 + p14, p12 - p14
    p13, p15 = p13 + p15, p13 - p15
    # h = 4
    p0, p4 = p0 + p4, p0 - p4
    p1, p5 = p1 + p5, p1 - p5
    p2, p6 = p2 + p6, p2 - p6
    p3, p7 = p3 + p7, p3 - p7
    p8, p12 = p8 + p12, p8 - p12
    p9, p13 = p9 + p13, p9 - p13
    p10, p14 = p10 + p14, p10 - p14
    p11, p15 = p11 + p15, p11 - p15
    # h = 8
    p0, p8 = p0 + p8, p0 - p8
    p1, p9 = p1 + p9, p1 - p9
    p2, p10 = p2 + p10, p2 - p10
    p3, p11 = p3 + p11, p3 - p11
    p4, p12 = p4 + p12, p4 - p12
    p5, p13 = p5 + p13, p5 - p13
    p6, p14 = p6 + p14, p6 - p14
    p7, p15 = p7 + p15, p7 - p15
    return p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15


@triton.jit
def _butterfly16(v, BR: tl.constexpr, NB: tl.constexpr):
    """v: [BR, NB, 16] -> each 16-run times H16 (unscaled), in formats.hadamard._butterfly's order:
    _butterfly16_parts put back together by joins, each adding a trailing axis inside the thread
    (the last join is position bit 0, so the first pairs p_j with p_(j+8)), and one reshape."""
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15 = _butterfly16_parts(v, BR, NB)
    a = tl.join(tl.join(tl.join(tl.join(p0, p8), tl.join(p4, p12)), tl.join(tl.join(p2, p10), tl.join(p6, p14))),
                tl.join(tl.join(tl.join(p1, p9), tl.join(p5, p13)), tl.join(tl.join(p3, p11), tl.join(p7, p15))))
    return tl.reshape(a, (BR, NB, 16))


@triton.jit
def _butterfly32(v, BR: tl.constexpr, NB: tl.constexpr):
    """v: [BR, NB, 32] -> each 32-run times H32 (unscaled), in formats.hadamard._butterfly's order:
    its first four stages work inside each half (the 16-point butterfly), the fifth adds and
    subtracts the halves."""
    a, b = tl.split(tl.permute(tl.reshape(v, (BR, NB, 2, 16)), (0, 1, 3, 2)))
    a, b = _butterfly16(a, BR, NB), _butterfly16(b, BR, NB)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BR, NB, 32))


@triton.jit
def _signed(x, seed, RULE: tl.constexpr, N: tl.constexpr):
    """x: [BR, NB, N] fp32 -> x times the rotation's signs (diag(signs) of formats.hadamard)."""
    j = tl.arange(0, N)
    if RULE == SIGNS_TE:
        negative = (TE_NEGATIVE >> j) & 1
    elif RULE == SIGNS_RANDOM:  # random signs: bit 0 of Philox bytes 0..N-1 of hadamard_seed (rng.random_bytes)
        groups = tl.arange(0, N // 16).to(tl.int64)[None, :]
        negative = tl.reshape(philox_bytes(seed, groups), (N,)) & 1
    else:
        negative = j * 0
    return x * (1 - 2 * negative).to(tl.float32)[None, None, :]


@triton.jit
def _hadamard(x, seed, RULE: tl.constexpr, ROUND_BF16: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
              N: tl.constexpr):
    """x: [BR, NB, N] fp32 (N = 16 or 32) -> each N-run times diag(signs) H_N / sqrt(N), in
    formats.hadamard's butterfly order (so the fp32 sums are the reference's), rounded to bf16
    when the input was bf16. TE's signs exist for N = 16 only (the launcher checks)."""
    v = _signed(x, seed, RULE, N)
    if N == 16:
        v = _butterfly16(v, BR, NB) * 0.25
    else:
        v = _butterfly32(v, BR, NB) * INV_SQRT32
    if ROUND_BF16:
        v = round_to_bf16(v)
    return v


@triton.jit
def _rotated_with_amax(x, seed, RULE: tl.constexpr, ROUND_BF16: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
                       N: tl.constexpr, FROM_PARTS: tl.constexpr):
    """x: [BR, NB, N] -> (x rotated as the rule says (_hadamard; NO_ROTATION: x itself), [BR, NB]
    int32 bits of each run's largest |value| after it, NaN and Inf included: the block amax
    _quantize_tile reads). With FROM_PARTS, at 16 points, the amax is taken from the butterfly's
    16 positions before they are joined, inside each thread, rather than by a reduction over the
    joined run; the 1/4 and the bf16 rounding go on once per run: p -> round(|p| / 4) is
    non-decreasing on finite values and maps NaN and Inf to NaN and Inf (checked over every fp32),
    so it commutes with the max, the poisoned-block verdict included. The codes quantize wants
    it (sm_90 SASS: 62 -> 42 an element, 102 -> 56 registers, RHT + SR along axis 0); the block
    values' stores want the run's own layout (with it: 52.5 -> 62.8, an extra layout change)."""
    # one return after a constexpr if/else (the compiler goes on past a return in a constexpr branch)
    if (RULE == NO_ROTATION) | (N != 16) | (not FROM_PARTS):
        v = x
        if RULE != NO_ROTATION:
            v = _hadamard(x, seed, RULE, ROUND_BF16, BR, NB, N)
        m = tl.max(_abs_key(v, False), axis=2)
    else:
        p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15 = \
            _butterfly16_parts(_signed(x, seed, RULE, 16), BR, NB)
        m = _max_key(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, False)
        m = tl.reshape(m, (BR, NB)).to(tl.float32, bitcast=True) * 0.25
        a = tl.join(tl.join(tl.join(tl.join(p0, p8), tl.join(p4, p12)), tl.join(tl.join(p2, p10), tl.join(p6, p14))),
                    tl.join(tl.join(tl.join(p1, p9), tl.join(p5, p13)), tl.join(tl.join(p3, p11), tl.join(p7, p15))))
        v = tl.reshape(a, (BR, NB, 16)) * 0.25
        if ROUND_BF16:
            v, m = round_to_bf16(v), round_to_bf16(m)
        m = m.to(tl.int32, bitcast=True)
    return v, m


@triton.jit
def _abs_key(p, FINITE: tl.constexpr):
    """fp32 -> a key that orders like |p|: int32 bits of |p|, NaN and Inf kept (they order above
    every finite value), or with FINITE elements.finite_key (uint32; NaN and Inf below every
    finite value, key_bits reads a max of them)."""
    # one return after a constexpr if/else: the compiler types every return, even one it skips
    if FINITE:
        key = finite_key(p)
    else:
        key = p.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return key


@triton.jit
def _max_key(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, FINITE: tl.constexpr):
    """The butterfly's 16 positions (_butterfly16_parts) -> the key of the largest |value| at each
    place (_abs_key), elementwise: inside each thread."""
    m = tl.maximum(tl.maximum(tl.maximum(_abs_key(p0, FINITE), _abs_key(p1, FINITE)),
                              tl.maximum(_abs_key(p2, FINITE), _abs_key(p3, FINITE))),
                   tl.maximum(tl.maximum(_abs_key(p4, FINITE), _abs_key(p5, FINITE)),
                              tl.maximum(_abs_key(p6, FINITE), _abs_key(p7, FINITE))))
    return tl.maximum(m, tl.maximum(tl.maximum(tl.maximum(_abs_key(p8, FINITE), _abs_key(p9, FINITE)),
                                               tl.maximum(_abs_key(p10, FINITE), _abs_key(p11, FINITE))),
                                    tl.maximum(tl.maximum(_abs_key(p12, FINITE), _abs_key(p13, FINITE)),
                                               tl.maximum(_abs_key(p14, FINITE), _abs_key(p15, FINITE)))))


@triton.jit
def _rotated_run_keys(x, seed, RULE: tl.constexpr, ROUND_BF16: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
                      N: tl.constexpr):
    """x: [BR, NB, N] -> [BR, NB] uint32: per run, the finite_key of the largest finite |value| of
    the run rotated as the rule says (NO_ROTATION: x itself). At 16 points, of the butterfly's
    unscaled and unrounded outputs, its 16 positions not put back in order (the max does not need
    it, and the joins cost layout changes): _rotated_amax_bits applies the 1/4 and the bf16
    rounding once, to the tensor's max. Taking the max first is exact: p -> round(|p| / 4) is
    non-decreasing, and finite for every finite p (|p| / 4 <= FLT_MAX / 4 lies below bf16's
    largest finite value)."""
    # one return after a constexpr if/else (the compiler goes on past a return in a constexpr branch)
    if (RULE == NO_ROTATION) | (N != 16):
        if RULE != NO_ROTATION:
            x = _hadamard(x, seed, RULE, ROUND_BF16, BR, NB, N)
        m = tl.max(finite_key(x), axis=2)
    else:
        p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15 = \
            _butterfly16_parts(_signed(x, seed, RULE, 16), BR, NB)
        m = _max_key(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, True)
        m = tl.max(m, axis=2)  # (a size-1 axis: no data moves)
    return m


@triton.jit
def _rotated_amax_bits(m, RULE: tl.constexpr, ROUND_BF16: tl.constexpr, N: tl.constexpr):
    """The max of _rotated_run_keys' runs (uint32 scalar) -> the int32 bits of the rotated tensor's
    finite amax: at 16 points the butterfly's 1/4 and the bf16 rounding, applied once."""
    m = key_bits(m)
    if (RULE != NO_ROTATION) & (N == 16):
        v = m.to(tl.float32, bitcast=True) * 0.25
        if ROUND_BF16:
            v = round_to_bf16(v)
        m = v.to(tl.int32, bitcast=True)
    return m


@triton.jit
def _rotated_finite_max_bits(x, seed, RULE: tl.constexpr, ROUND_BF16: tl.constexpr, BR: tl.constexpr,
                             NB: tl.constexpr, N: tl.constexpr):
    """x: [BR, NB, N] -> int32 bits of the largest finite |value| of x rotated as the rule says
    (NO_ROTATION: x itself; 0 if none): the tile's share of a tensor amax, folded in with an atomic max."""
    return _rotated_amax_bits(tl.max(_rotated_run_keys(x, seed, RULE, ROUND_BF16, BR, NB, N)), RULE, ROUND_BF16, N)


@triton.jit
def _te_candidate(bamax, mult, s_dec):
    """NVFP4 te block scale bytes and element scales for a block multiplier."""
    sbyte = e4m3_rtne(tl.minimum(bamax * mult, 448.0))
    return sbyte, tl.minimum(tl.div_rn(tl.full(bamax.shape, 1.0, tl.float32), e4m3_value(sbyte) * s_dec), FLT_MAX)


@triton.jit
def _squared_error(mag, sbyte, e_b, s_dec):
    """|x| [BR, NB, BLOCK] -> the squared error of its round-to-nearest quantization with (s_b, e_b)."""
    code = e2m1_rtne(tl.minimum(mag * e_b[:, :, None], 6.0))
    d = (e2m1_value(code) * e4m3_value(sbyte)[:, :, None]) * s_dec - mag
    return d * d


@triton.jit
def _block_error(sq, TILE_ROWS: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr):
    """formats.nvfp4.block_error: [BR, NB, 16] -> [BR, NB], pairwise per block, or per 16x16
    tile by 2x2 quads (a + d) + (b + c), replicated to the tile's rows."""
    # one return after a constexpr if/else: Triton's compiler (unlike its interpreter) goes on
    # past a return inside a constexpr branch and would trace the tile path for 1x16 blocks too
    if TILE_ROWS == 1:  # neighbours added pairwise: 16 -> 8 -> 4 -> 2 -> 1
        a, b = tl.split(tl.reshape(sq, (BR, NB, 8, 2)))
        a, b = tl.split(tl.reshape(a + b, (BR, NB, 4, 2)))
        a, b = tl.split(tl.reshape(a + b, (BR, NB, 2, 2)))
        a, b = tl.split(tl.reshape(a + b, (BR, NB, 1, 2)))
        err = tl.reshape(a + b, (BR, NB))
    else:
        T: tl.constexpr = BR // TILE_ROWS
        t = tl.permute(tl.reshape(sq, (T, TILE_ROWS, NB, BLOCK)), (0, 2, 1, 3))  # [T, NB, rows, cols]
        t = _quads(t, T, NB, 8)
        t = _quads(t, T, NB, 4)
        t = _quads(t, T, NB, 2)
        t = tl.reshape(_quads(t, T, NB, 1), (T, 1, NB))
        err = tl.reshape(tl.broadcast_to(t, (T, TILE_ROWS, NB)), (BR, NB))
    return err


@triton.jit
def _quads(t, T: tl.constexpr, NB: tl.constexpr, N: tl.constexpr):
    """[T, NB, 2N, 2N] -> [T, NB, N, N]: each 2x2 quad [[a, b], [c, d]] as (a + d) + (b + c)."""
    q = tl.permute(tl.reshape(t, (T, NB, N, 2, N, 2)), (0, 1, 2, 4, 3, 5))  # [.., i, j, row, col]
    left, right = tl.split(q)  # col 0, col 1: [.., i, j, row]
    a, c = tl.split(left)
    b, d = tl.split(right)
    return (a + d) + (b + c)


@triton.jit
def _mx_exponent(bamax, RULE: tl.constexpr):
    """bamax: fp32 >= 0 finite -> int32 unbiased exponent in [-127, 127] (formats.mxfp4.mx_exponent)."""
    bits = bamax.to(tl.int32, bitcast=True)
    exp, man = (bits >> 23) - 127, bits & 0x7FFFFF
    if RULE == MX_FLOOR:
        e = exp - 2
    elif RULE == MX_CEIL:
        e = exp + (man != 0).to(tl.int32) - 2
    elif RULE == MX_EVEN:
        e = exp + (man >= 0x600000).to(tl.int32) - 2
    else:  # MX_RCEIL
        qbits = (bamax * 0.1666666716337204).to(tl.int32, bitcast=True)  # fp32(1/6)
        qexp, qman = (qbits >> 23) - 127, qbits & 0x7FFFFF
        e = qexp + (qman != 0).to(tl.int32)
        # an fp32-subnormal quotient: ceil(log2) is -126 above 2^-127, else clamped to -127
        e = tl.where(qexp == -127, tl.where(qman > 0x400000, -126, -127), e)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(bamax == 0, -127, e)


@cached  # (launched through kernels.launch)
@triton.jit
def _fp4_quantize_kernel(x_ptr, codes_ptr, scales_ptr, amax_ptr, s_dec_ptr, seed, hadamard_seed,
                         start_ptr, seeds_ptr, h_seeds_ptr, n_groups, src_ptr,
                         R, L, R_OUT, LP, stride_r, stride_c,
                         SCALE_RULE: tl.constexpr, BLOCK: tl.constexpr, TILE_ROWS: tl.constexpr,
                         STOCHASTIC: tl.constexpr, BF16_BITS: tl.constexpr, HADAMARD: tl.constexpr,
                         AMAX_ONLY: tl.constexpr, OUT_VALUES: tl.constexpr, TRANSPOSED: tl.constexpr,
                         GROUPED: tl.constexpr, SEED_IN_MEMORY: tl.constexpr, H_SEED_IN_MEMORY: tl.constexpr,
                         SRC_GROUPS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    NB: tl.constexpr = BC // BLOCK
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    # what Philox counts: group index = local row * lp_of / 16 + column / 16 - col_base
    col_base = tl.program_id(1) * (BC // 16)
    src_shift, data_end = 0, L  # x read as the layout runs (unpadded column groups below shift it)
    if GROUPED == ROW_GROUPS:  # each row's group: its own amax, S_dec and seed
        group = group_of(rows, start_ptr, n_groups)
        local = rows - tl.load(start_ptr + group)  # the row within its group
        amax_at, seed_of, h_seed, lp_of = amax_ptr + group, tl.load(seeds_ptr + group)[:, None], hadamard_seed, LP
    elif GROUPED == COL_GROUPS:  # the program's columns lie in one group (start_ptr holds G + 1 edges)
        col0 = tl.program_id(1) * BC
        group = group_of(col0, start_ptr, n_groups)
        start = tl.load(start_ptr + group)
        local, amax_at, seed_of = rows, amax_ptr + group, tl.load(seeds_ptr + group)
        h_seed, lp_of = tl.load(h_seeds_ptr + group), tl.load(start_ptr + group + 1) - start
        col_base = (col0 - start) // 16
        if SRC_GROUPS:  # x unpadded: group g's rows sit src_ptr[g] earlier there, src_ptr[G + g] of them
            src_shift, data_end = tl.load(src_ptr + group), start + tl.load(src_ptr + n_groups + group)
    else:
        local, amax_at, seed_of, h_seed, lp_of, group = rows, amax_ptr, seed, hadamard_seed, LP, 0
        if SEED_IN_MEMORY:  # a device seed (seeds_ptr[0]): a captured graph reads each replay's own
            seed_of = tl.load(seeds_ptr)
        if H_SEED_IN_MEMORY:
            h_seed = tl.load(h_seeds_ptr)
    cols = (tl.program_id(1) * BC + tl.arange(0, BC)).to(tl.int64)
    src = cols - src_shift  # where column `cols` of the (padded) layout lies in x; past data_end: zeros
    if TRANSPOSED:  # rows are contiguous in memory: load the tile the way memory runs, flip in registers
        inside_t = (cols[:, None] < data_end) & (rows[None, :] < R)
        x = tl.trans(tl.load(x_ptr + src[:, None] * stride_c + rows[None, :] * stride_r, mask=inside_t, other=0.0))
    else:
        inside = (rows[:, None] < R) & (cols[None, :] < data_end)
        x = tl.load(x_ptr + rows[:, None] * stride_r + src[None, :] * stride_c, mask=inside, other=0.0)
    x = tl.reshape(widen(x, BF16_BITS), (BR, NB, BLOCK))
    if AMAX_ONLY:  # the first pass of a rotated quantize: the rotated tensor's finite amax (never asked
        # of row groups)
        tl.atomic_max(amax_at, _rotated_finite_max_bits(x, h_seed, HADAMARD, BF16_BITS, BR, NB, BLOCK))
        return
    x, amax_bits = _rotated_with_amax(x, h_seed, HADAMARD, BF16_BITS, BR, NB, BLOCK, not OUT_VALUES)
    _quantize_tile(x, amax_bits, rows, local, col_base, group, amax_at, seed_of, lp_of, codes_ptr, scales_ptr,
                   s_dec_ptr, R, R_OUT, LP, tl.program_id(0), tl.program_id(1), SCALE_RULE, BLOCK, TILE_ROWS,
                   STOCHASTIC, OUT_VALUES, GROUPED, BR, BC)


@triton.jit
def _quantize_tile(x, amax_bits, rows, local, col_base, group, amax_at, seed_of, lp_of, codes_ptr, scales_ptr,
                   s_dec_ptr, R, R_OUT, LP, pid_r, pid_c, SCALE_RULE: tl.constexpr, BLOCK: tl.constexpr,
                   TILE_ROWS: tl.constexpr, STOCHASTIC: tl.constexpr, OUT_VALUES: tl.constexpr,
                   GROUPED: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """One tile, loaded (and rotated) as x [BR, NB, BLOCK] fp32, quantized and stored: program
    (pid_r, pid_c) of a grid over the stored layout [R_OUT, LP]; ``amax_bits`` [BR, NB] int32 the
    bits of each block's largest |x| (_rotated_with_amax), NaN and Inf included; ``rows`` its rows,
    ``local`` and ``col_base`` where its Philox groups count from, ``group`` its group (grouped
    launches)."""
    NB: tl.constexpr = BC // BLOCK
    # one integer maximum gives both the amax and the verdict: |x| bits order like |x|, and a
    # block whose largest bits are Inf/NaN's (>= 0x7F800000) is poisoned, its amax unused
    if TILE_ROWS > 1:  # one amax per 16x16 tile, replicated to its 16 rows
        tile = tl.max(tl.reshape(amax_bits, (BR // TILE_ROWS, TILE_ROWS, NB)), axis=1)
        amax_bits = tl.reshape(tl.broadcast_to(tile[:, None, :], (BR // TILE_ROWS, TILE_ROWS, NB)), (BR, NB))
    bad = (amax_bits >= 0x7F800000).to(tl.int32)
    bamax = tl.where(bad > 0, 0, amax_bits).to(tl.float32, bitcast=True)

    NVFP4: tl.constexpr = SCALE_RULE < MX_FLOOR  # the NVFP4 profiles come first
    if NVFP4:
        if GROUPED == ROW_GROUPS:  # [BR, 1]: each row's group's terms
            s_dec, mult = _tensor_terms(tl.load(amax_at).to(tl.float32, bitcast=True)[:, None], SCALE_RULE)
            if pid_c == 0:  # each group's first row writes its S_dec (every row has the same one)
                tl.store(s_dec_ptr + group, tl.reshape(s_dec, (BR,)), mask=(rows < R) & (local == 0))
            s_dec_e = s_dec[:, :, None]  # against [BR, NB, BLOCK]
        else:
            s_dec, mult = _tensor_terms(tl.load(amax_at).to(tl.float32, bitcast=True), SCALE_RULE)
            if GROUPED == COL_GROUPS:
                if pid_r == 0:  # every program of a group writes the same S_dec
                    tl.store(s_dec_ptr + group, s_dec)
            elif (pid_r == 0) & (pid_c == 0):
                tl.store(s_dec_ptr, s_dec)
            s_dec_e = s_dec
    if SCALE_RULE == NV_TE:  # NVFP4 te: s_b = e4m3(min(amax_b * (S_enc/6), 448)), e_b = 1/(s_b S_dec)
        sbyte, e_b = _te_candidate(bamax, mult, s_dec)
        nan_byte = 0x7F
    elif SCALE_RULE == NV_FOUR_SIX:  # both te candidates (amax to 6, to 4); the smaller error wins
        mag = tl.abs(x)
        s6, e6 = _te_candidate(bamax, mult * 0.1666666716337204, s_dec)  # fp32(1/6)
        s4, e4 = _te_candidate(bamax, mult * 0.25, s_dec)
        err6 = _block_error(_squared_error(mag, s6, e6, s_dec_e), TILE_ROWS, BR, NB, BLOCK)
        err4 = _block_error(_squared_error(mag, s4, e4, s_dec_e), TILE_ROWS, BR, NB, BLOCK)
        four = err4 < err6
        sbyte, e_b = tl.where(four, s4, s6), tl.where(four, e4, e6)
        nan_byte = 0x7F
    elif SCALE_RULE == NV_TORCHAO:  # NVFP4 torchao: s_b = e4m3(clamp(amax_b/6/S_dec, 2^-6, 448)), e_b = (1/S_dec)/s_b
        sbyte = e4m3_rtne(tl.minimum(tl.maximum(tl.div_rn(tl.div_rn(bamax, 6.0), s_dec), 0.015625), 448.0))
        e_b = tl.div_rn(mult + tl.zeros_like(bamax), e4m3_value(sbyte))
        nan_byte = 0x7F
    else:  # MXFP4: s_b = 2^e, e_b = 2^-e exactly
        e = _mx_exponent(bamax, SCALE_RULE)
        sbyte = e + 127
        e_b = tl.where(e == 127, (0x400000 + tl.zeros_like(e)), (127 - e) << 23).to(tl.float32, bitcast=True)
        nan_byte = 0xFF

    if STOCHASTIC:  # group g = row * LP/16 + col/16: rng.random_bytes over the stored layout
        groups = local[:, None] * (lp_of // 16) + (col_base + tl.arange(0, BC // 16))[None, :]
        rand = tl.reshape(philox_bytes(seed_of, groups), (BR, NB, BLOCK))

    keep = rows[:, None] < R_OUT
    # no early return: a return inside a constexpr branch of a helper is not where the compiler stops
    if OUT_VALUES:  # code * block scale as bf16 bits, the operand an emulated GEMM multiplies: the
        # product of a 2-bit grid value and an E4M3 / UE8M0 scale is exact in fp32 and in bf16 (or
        # overflows to Inf in both), so its fp32 bits' top half is the bf16; a poisoned block is NaN.
        # |clamp(x e_b, -6, 6)| is min(|x| e_b, 6) (rounding is sign-symmetric); the sign is x's (e_b > 0)
        product = tl.abs(x) * e_b[:, :, None]
        mag = tl.minimum(product, 6.0)  # (a NaN product, 0 * Inf, gives 6: the reference's code 7)
        sign = x.to(tl.int32, bitcast=True) & -0x80000000
        if SCALE_RULE == NV_TORCHAO:  # the one rule whose e_b may be Inf (amax below ~5e-34): the
            sign = tl.where(product != product, 0, sign)  # reference encodes 0 * Inf as +6, whatever 0's sign
        if STOCHASTIC:
            q = e2m1_stochastic_value(mag, rand)
        else:
            q = e2m1_rtne_value(mag)
        bits = (q * scale_value(sbyte, NVFP4)[:, :, None]).to(tl.int32, bitcast=True)
        bits = tl.where(bad[:, :, None] > 0, 0x7FC00000, bits | sign)
        vcols = pid_c * BC + tl.arange(0, BC)
        tl.store(codes_ptr + rows[:, None] * LP + vcols[None, :], tl.reshape(bits >> 16, (BR, BC)).to(tl.int16),
                 mask=keep & (vcols[None, :] < LP))
    else:
        product = x * e_b[:, :, None]
        # |clamp(x e_b, -6, 6)| is min(|x e_b|, 6), one instruction (the absolute value is an
        # operand modifier); a NaN product (0 * Inf) gives 6, the reference's code 7
        mag = tl.minimum(tl.abs(product), 6.0)
        pbits = product.to(tl.int32, bitcast=True)
        if SCALE_RULE == NV_TORCHAO:  # 0 * Inf e_b: the reference encodes +6, whatever the NaN's sign
            pbits = tl.where(product != product, 0, pbits)
        if STOCHASTIC:
            code = e2m1_stochastic(mag, rand)
        else:
            code = e2m1_rtne(mag)
        code = tl.where(bad[:, :, None] > 0, 0, code | ((pbits >> 28) & 8))  # (bit 3: the sign)
        sbyte = tl.where(bad > 0, nan_byte, sbyte)
        packed = pack_nibble_pairs(tl.reshape(code, (BR, BC)), BR, BC)
        pcols = pid_c * (BC // 2) + tl.arange(0, BC // 2)
        tl.store(codes_ptr + rows[:, None] * (LP // 2) + pcols[None, :], packed,
                 mask=keep & (pcols[None, :] < LP // 2))
        scols = pid_c * NB + tl.arange(0, NB)
        tl.store(scales_ptr + rows[:, None] * (LP // BLOCK) + scols[None, :], sbyte.to(tl.uint8),
                 mask=keep & (scols[None, :] < LP // BLOCK))


@cached  # (launched through kernels.launch)
@triton.jit
def _fp4_pair_kernel(x_ptr, rows_ptr, cols_ptr, amax_ptr, s_dec_ptr, seed_r, seed_c, h_seed_c, seed_r_ptr,
                     seed_c_ptr, h_seed_c_ptr, partner_r_ptr, partner_c_ptr, M, K, MP, stride_m,
                     RULE_R: tl.constexpr, RULE_C: tl.constexpr, BLOCK: tl.constexpr, STOCHASTIC_R: tl.constexpr,
                     STOCHASTIC_C: tl.constexpr, HADAMARD_C: tl.constexpr, BF16_BITS: tl.constexpr,
                     AMAX_ONLY: tl.constexpr, SEED_R_IN_MEMORY: tl.constexpr, SEED_C_IN_MEMORY: tl.constexpr,
                     H_SEED_IN_MEMORY: tl.constexpr, PARTNER_R: tl.constexpr, PARTNER_C: tl.constexpr,
                     BM: tl.constexpr, BK: tl.constexpr, ITERS: tl.constexpr):
    """Both copies of x [M, K] (row-major) a linear layer quantizes, from one read of each tile:
    the rows copy (blocks along K: [M, K] values, amax and S_dec slot 0) and the columns copy
    (blocks along M, rotated when asked, M zero-padded to MP: [K, MP] values, slot 1). Each copy's
    program is the single-copy kernel's for the same tile, so the bytes are the same. A program
    takes ITERS tiles down the rows (the amax pass keeps elementwise maxima until the end): one
    tile alone spent much of its instructions on a program's fixed work (the sign draw, the
    tensor terms, the amax pass's tile-wide reductions and atomics). With PARTNER_R (PARTNER_C),
    slot 2 (3) gets the rows (columns) copy's S_dec times the [] fp32 at partner_r_ptr
    (partner_c_ptr): the tensor-scale product of the copy's GEMM, one fp32 multiply as the GEMM
    epilogue's, so a GEMM that takes one alpha launches nothing for it."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    cols = (pid_k * BK + tl.arange(0, BK)).to(tl.int64)
    if H_SEED_IN_MEMORY:
        h_seed_c = tl.load(h_seed_c_ptr)
    if AMAX_ONLY:  # both tensor amaxes (finite values only), x read once
        m_rows = tl.zeros((BM, BK), tl.uint32)  # (elements.finite_key: a zero key reads as no finite value)
        m_cols = tl.zeros((BK, BM // BLOCK), tl.uint32)
        for i in range(ITERS):
            rows = ((pid_m * ITERS + i) * BM + tl.arange(0, BM)).to(tl.int64)
            inside = (rows[:, None] < M) & (cols[None, :] < K)  # (rows past M: zeros, the columns copy's padding)
            x = widen(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=inside, other=0.0), BF16_BITS)
            m_rows = tl.maximum(m_rows, finite_key(x))
            m_cols = tl.maximum(m_cols, _rotated_run_keys(tl.reshape(tl.trans(x), (BK, BM // BLOCK, BLOCK)),
                                                          h_seed_c, HADAMARD_C, BF16_BITS, BK, BM // BLOCK, BLOCK))
        tl.atomic_max(amax_ptr, key_bits(tl.max(m_rows)))
        tl.atomic_max(amax_ptr + 1, _rotated_amax_bits(tl.max(m_cols), HADAMARD_C, BF16_BITS, BLOCK))
    else:  # the two copies, ITERS tiles down the rows a program
        if SEED_R_IN_MEMORY:  # device seeds: a captured graph reads each replay's own
            seed_r = tl.load(seed_r_ptr)
        if SEED_C_IN_MEMORY:
            seed_c = tl.load(seed_c_ptr)
        for i in range(ITERS):
            tile_m = pid_m * ITERS + i
            rows = (tile_m * BM + tl.arange(0, BM)).to(tl.int64)
            inside = (rows[:, None] < M) & (cols[None, :] < K)
            x = widen(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=inside, other=0.0), BF16_BITS)
            xr, amax_r = _rotated_with_amax(tl.reshape(x, (BM, BK // BLOCK, BLOCK)), 0, NO_ROTATION, BF16_BITS,
                                            BM, BK // BLOCK, BLOCK, False)
            xc, amax_c = _rotated_with_amax(tl.reshape(tl.trans(x), (BK, BM // BLOCK, BLOCK)), h_seed_c, HADAMARD_C,
                                            BF16_BITS, BK, BM // BLOCK, BLOCK, False)
            _quantize_tile(xr, amax_r, rows, rows, pid_k * (BK // 16), 0, amax_ptr, seed_r, K, rows_ptr, rows_ptr,
                           s_dec_ptr, M, M, K, tile_m, pid_k, RULE_R, BLOCK, 1, STOCHASTIC_R, True, NO_GROUPS, BM, BK)
            _quantize_tile(xc, amax_c, cols, cols, tile_m * (BM // 16), 0, amax_ptr + 1, seed_c, MP, cols_ptr,
                           cols_ptr, s_dec_ptr + 1, K, K, MP, pid_k, tile_m, RULE_C, BLOCK, 1, STOCHASTIC_C, True,
                           NO_GROUPS, BK, BM)
        if (pid_m == 0) & (pid_k == 0):
            if PARTNER_R:  # (the S_dec _quantize_tile stores, from the same amax)
                s_r = _tensor_terms(tl.load(amax_ptr).to(tl.float32, bitcast=True), RULE_R)[0]
                tl.store(s_dec_ptr + 2, s_r * tl.load(partner_r_ptr))
            if PARTNER_C:
                s_c = _tensor_terms(tl.load(amax_ptr + 1).to(tl.float32, bitcast=True), RULE_C)[0]
                tl.store(s_dec_ptr + 3, s_c * tl.load(partner_c_ptr))


class _LaunchPlan:
    """What one quantize launch takes from its call's shape, strides, dtype and switches (tensors
    and seeds aside): worked out once per such call (an FP4 linear makes the same calls every
    step) and kept. The block axis is read as columns: axis 0 of a 2D tensor transposed in place,
    other layouts made contiguous with the block axis last (``moves``) unless they are already."""

    def __init__(self, x: torch.Tensor, axis: int, block: tuple[int, int], pad: bool, rule: int, stochastic: bool,
                 hadamard: int, amax_only: bool, out_values: bool, group_mode: int, src_len: int | None,
                 in_memory: tuple[bool, bool]) -> None:
        axis, pads = check_input(x, axis, block, pad or src_len is not None)
        self.axis = axis
        shape = list(x.shape)
        if x.dim() == 2 and axis == 0:
            self.moves = False
            rows, length, stride_r, stride_c = shape[1], shape[0], x.stride(1), x.stride(0)
        else:
            length = shape.pop(axis)
            rows = math.prod(shape)
            self.moves = axis != x.dim() - 1 or not x.is_contiguous()
            stride_r, stride_c = length, 1
        if src_len is not None:  # the kernel reads x's groups where the padded layout puts them
            length, pads[0] = src_len, 0
        lp, rows_out = length + pads[0], rows + pads[1]
        lead = [rows_out] if block[0] != 1 else [n for i, n in enumerate(x.shape) if i != axis]
        self.values_shape = (*lead, lp)
        self.codes_shape, self.scales_shape = (*lead, lp // 2), (*lead, lp // block[1])
        self.sizes = (rows, length, rows_out, lp, stride_r, stride_c)
        self.grid = None  # (nothing to launch: an empty output)
        self.bf16 = x.dtype == torch.bfloat16
        if rows_out * lp:
            # a transposed read (axis 0 of a contiguous matrix) loads [BC, BR] tiles along memory
            transposed = stride_r == 1 and stride_c != 1
            br, bc, warps = TILES["transposed" if transposed else "rows"]
            if group_mode == COL_GROUPS.value:  # a column tile must not straddle two groups
                bc = COL_GROUP_WIDTH
            self.grid = (cdiv(rows_out, br), cdiv(lp, bc))
            self.kernel = _fp4_quantize_kernel.bind(
                SCALE_RULE=rule, BLOCK=block[1], TILE_ROWS=block[0], STOCHASTIC=stochastic, BF16_BITS=self.bf16,
                HADAMARD=hadamard, AMAX_ONLY=amax_only, OUT_VALUES=out_values, TRANSPOSED=transposed,
                GROUPED=group_mode, SEED_IN_MEMORY=in_memory[0], H_SEED_IN_MEMORY=in_memory[1],
                SRC_GROUPS=src_len is not None, BR=br, BC=bc, num_warps=warps, enable_fp_fusion=False)


_LAUNCH_PLANS = PlanTable(512)  # key -> _LaunchPlan


def _launch(x: torch.Tensor, axis: int, block: tuple[int, int], pad: bool, rule: int,
            amax: torch.Tensor | None, s_dec: torch.Tensor | None, stochastic: bool, seed: int | torch.Tensor,
            hadamard: int = NO_ROTATION.value, hadamard_seed: int | torch.Tensor = 0, amax_only: bool = False,
            out_values: bool = False, grouped: tuple | None = None, group_mode: int = NO_GROUPS.value,
            src_groups: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One quantize launch (grouped: (edges, seeds, hadamard seeds, groups) device tensors and
    count, group_mode ROW_GROUPS or COL_GROUPS). A seed given as a tensor (_kernel_seed) is read
    by the kernel from memory. ``src_groups`` (COL_GROUPS only): (each group's shift and row count
    on the device, the padded length): x holds the groups unpadded, read as the padded layout."""
    if src_groups is not None and group_mode != COL_GROUPS.value:
        raise ValueError("a quantize launch reads unpadded groups (src_groups) along columns only (COL_GROUPS)")
    in_memory = (isinstance(seed, torch.Tensor), isinstance(hadamard_seed, torch.Tensor))
    src_len = None if src_groups is None else src_groups[1]
    # (the tiles a plan was made with are part of its key: a sweep that changes TILES gets plans of the new tile)
    key = (x.shape, x.stride(), x.dtype, axis, block, pad, rule, stochastic, hadamard, amax_only, out_values,
           group_mode, src_len, in_memory, TILES["rows"], TILES["transposed"], COL_GROUP_WIDTH)
    plan = _LAUNCH_PLANS.get(key)
    if plan is None:  # (check_input raises for a call it refuses: nothing kept)
        plan = _LAUNCH_PLANS.keep(key, _LaunchPlan(x, axis, block, pad, rule, stochastic, hadamard, amax_only,
                                                   out_values, group_mode, src_len, in_memory))
    src = x.movedim(plan.axis, -1).contiguous() if plan.moves else x
    if amax_only:  # the kernel returns before any store: no output buffers
        codes = scales = amax
    elif out_values:  # bf16 block values (as int16 bits) in place of codes; no scale bytes
        codes = scales = torch.empty(plan.values_shape, dtype=torch.int16, device=x.device)
    else:
        codes = torch.empty(plan.codes_shape, dtype=torch.uint8, device=x.device)
        scales = torch.empty(plan.scales_shape, dtype=torch.uint8, device=x.device)
    if plan.grid is not None:
        if grouped is None:  # the seeds' pointers: device seeds where given, else unused
            grouped = (codes, seed if in_memory[0] else codes, hadamard_seed if in_memory[1] else codes, 1)
        plan.kernel[plan.grid](src.view(torch.int16) if plan.bf16 else src, codes, scales,
                               codes if amax is None else amax, codes if s_dec is None else s_dec,
                               0 if in_memory[0] else seed, 0 if in_memory[1] else hadamard_seed, *grouped,
                               codes if src_groups is None else src_groups[0], *plan.sizes)
    return codes, scales, plan.axis


def _kernel_seed(seed: int | torch.Generator | torch.Tensor | None) -> int | torch.Tensor:
    """A seed as the kernels take it: an int64 kernel argument, or a device seed (a one-element
    int64 tensor, formats.blocks.seed_key) that the kernel reads at launch, so a launch
    captured in a CUDA graph draws whatever the tensor holds at each replay."""
    value = seed_key(seed)
    if isinstance(value, torch.Tensor):
        return value
    if not 0 <= value < 2**63:
        raise ValueError(f"the Triton path takes seeds in [0, 2**63), got {value}")
    return value


def _seed(rounding: Rounding, seed: int | torch.Generator | torch.Tensor | None) -> int | torch.Tensor:
    return 0 if rounding is Rounding.RTNE else _kernel_seed(seed)


def quantize_nvfp4(x: torch.Tensor, *, axis: int = -1, block: int | tuple[int, int] = 16,
                   rounding: str | Rounding = Rounding.RTNE, seed: int | torch.Generator | None = None,
                   profile: str | NVFP4Profile = NVFP4Profile.TE,
                   global_amax: float | torch.Tensor | None = None, pad: bool = False,
                   hadamard: str | HadamardSigns | None = None,
                   hadamard_seed: int | torch.Generator | None = None) -> FP4Tensor:
    """Triton twin of fp4lab.formats.quantize_nvfp4 (same arguments, same bytes); the Hadamard
    rotation is fused into the quantize (and into its amax pass)."""
    return _nvfp4(x, False, axis=axis, block=block, rounding=rounding, seed=seed, profile=profile,
                  global_amax=global_amax, pad=pad, hadamard=hadamard, hadamard_seed=hadamard_seed)


def nvfp4_block_values(x: torch.Tensor, **kwargs) -> BlockValues:
    """quantize_nvfp4(x, **kwargs) decoded to its block values in the same pass: writes bf16
    code * block scale (exact) instead of codes and scale bytes (formats.block_values)."""
    return _nvfp4(x, True, **kwargs)


def _nvfp4(x: torch.Tensor, out_values: bool, *, axis: int = -1, block: int | tuple[int, int] = 16,
           rounding: str | Rounding = Rounding.RTNE, seed: int | torch.Generator | None = None,
           profile: str | NVFP4Profile = NVFP4Profile.TE, global_amax: float | torch.Tensor | None = None,
           pad: bool = False, hadamard: str | HadamardSigns | None = None,
           hadamard_seed: int | torch.Generator | None = None) -> FP4Tensor | BlockValues:
    key = plan = None
    if isinstance(x, torch.Tensor):
        try:
            key = (x.shape, x.dtype, operator.index(axis), block, rounding, profile, pad, hadamard)
            plan = _NVFP4_PLANS.get(key)
        except TypeError:  # an unhashable argument, or an axis that is no index: worked out afresh (and refused there)
            key = None
    if plan is None:
        block2, rounding, profile = _nvfp4_block(block), Rounding.parse(rounding), NVFP4Profile.parse(profile)
        axis0, _ = check_input(x, axis, block2, pad)
        plan = _Nvfp4Plan(block2, rounding, profile, _fused_rotation_rule(x, axis, 16, hadamard),
                          hadamard is not None and HadamardSigns.parse(hadamard) is HadamardSigns.RANDOM,
                          _logical_rows(x, axis0))
        if key is not None:
            _NVFP4_PLANS.keep(key, plan)
    block2, rounding, profile, rotation = plan.block, plan.rounding, plan.profile, plan.rotation
    if rotation is None:  # a rotation the kernel does not take: the reference, its results or its errors
        _warn_reference()
        from .. import formats
        q = formats.quantize_nvfp4(x, axis=axis, block=block2, rounding=rounding, seed=seed, profile=profile,
                                   global_amax=global_amax, pad=pad, hadamard=hadamard, hadamard_seed=hadamard_seed)
        return BlockValues.of(q) if out_values else q
    h_seed = _kernel_seed(hadamard_seed) if plan.random_signs else 0
    if global_amax is None and rotation != NO_ROTATION.value:
        amax = zeroed_int32(1, x.device)  # (the kernels take its address; [1] as finite_amax_bits')
        _launch(x, axis, block2, pad, NV_TE.value, amax, None, False, 0, rotation, h_seed, amax_only=True)
    elif global_amax is None:
        amax = finite_amax_bits(x)
    elif isinstance(global_amax, torch.Tensor) and global_amax.is_cuda:
        amax = global_amax.reshape(()).to(torch.float32).view(torch.int32)
    else:
        amax = _check_amax(global_amax, x.device).view(torch.int32)
    # written by the kernel: no fill launch (traced, a [1] viewed as []: Inductor lowers an empty [] to a fill)
    s_dec = (torch.empty(1, dtype=torch.float32, device=x.device).view(()) if tracing()
             else torch.empty((), dtype=torch.float32, device=x.device))
    if x.numel() == 0:
        s_dec = nvfp4_tensor_terms(amax.view(torch.float32).reshape(()), profile)[0]
    codes, scales, axis = _launch(x, axis, block2, pad, NV_RULES[profile], amax, s_dec, rounding is Rounding.STOCHASTIC,
                                  _seed(rounding, seed), rotation, h_seed, out_values=out_values)
    if out_values:
        return BlockValues(codes.view(torch.bfloat16).reshape(-1, codes.shape[-1]), s_dec, plan.rows, Format.NVFP4)
    return FP4Tensor(codes=codes, scales=scales.view(torch.float8_e4m3fn), tensor_scale=s_dec,
                     shape=x.shape, axis=axis, block=block2, format=Format.NVFP4, rounding=rounding,
                     profile=profile)


class _Nvfp4Plan(NamedTuple):
    """What an NVFP4 quantize takes from its call's shape, dtype and keywords (seeds, amax and the
    tensor aside): parsed and checked once per such call, and kept."""

    block: tuple[int, int]
    rounding: Rounding
    profile: NVFP4Profile
    rotation: int | None  # the kernel's HADAMARD rule; None: a rotation it does not take (the reference runs)
    random_signs: bool  # (the rotation draws its signs from hadamard_seed)
    rows: int  # (_logical_rows)


_NVFP4_PLANS = PlanTable(512)  # key -> _Nvfp4Plan


def quantize_mxfp4(x: torch.Tensor, *, axis: int = -1, mode: str | MXScaleMode = MXScaleMode.FLOOR,
                   rounding: str | Rounding = Rounding.RTNE, seed: int | torch.Generator | None = None,
                   pad: bool = False, hadamard: str | HadamardSigns | None = None,
                   hadamard_seed: int | torch.Generator | None = None) -> FP4Tensor:
    """Triton twin of fp4lab.formats.quantize_mxfp4 (same arguments, same bytes)."""
    return _mxfp4(x, False, axis=axis, mode=mode, rounding=rounding, seed=seed, pad=pad, hadamard=hadamard,
                  hadamard_seed=hadamard_seed)


def mxfp4_block_values(x: torch.Tensor, **kwargs) -> BlockValues:
    """quantize_mxfp4(x, **kwargs) decoded to its block values (bf16 code * 2^e) in the same pass."""
    return _mxfp4(x, True, **kwargs)


def _mxfp4(x: torch.Tensor, out_values: bool, *, axis: int = -1, mode: str | MXScaleMode = MXScaleMode.FLOOR,
           rounding: str | Rounding = Rounding.RTNE, seed: int | torch.Generator | None = None,
           pad: bool = False, hadamard: str | HadamardSigns | None = None,
           hadamard_seed: int | torch.Generator | None = None) -> FP4Tensor | BlockValues:
    mode, rounding = MXScaleMode.parse(mode), Rounding.parse(rounding)
    check_input(x, axis, (1, MX_BLOCK), pad)
    fused = _fused_rotation(x, axis, MX_BLOCK, hadamard, hadamard_seed)
    if fused is None:
        from .. import formats
        q = formats.quantize_mxfp4(x, axis=axis, mode=mode, rounding=rounding, seed=seed, pad=pad,
                                   hadamard=hadamard, hadamard_seed=hadamard_seed)
        return BlockValues.of(q) if out_values else q
    codes, scales, axis = _launch(x, axis, (1, MX_BLOCK), pad, MX_RULES[mode], None, None,
                                  rounding is Rounding.STOCHASTIC, _seed(rounding, seed), *fused,
                                  out_values=out_values)
    if out_values:
        return BlockValues(codes.view(torch.bfloat16).reshape(-1, codes.shape[-1]), None, _logical_rows(x, axis),
                           Format.MXFP4)
    return FP4Tensor(codes=codes, scales=scales, tensor_scale=None, shape=x.shape, axis=axis,
                     block=(1, MX_BLOCK), format=Format.MXFP4, rounding=rounding, mx_mode=mode)


def _fused_rotation(x: torch.Tensor, axis: int, size: int, hadamard: str | HadamardSigns | None,
                    hadamard_seed: int | torch.Generator | None) -> tuple[int, int] | None:
    """The kernel's (HADAMARD rule, seed) for a requested rotation of ``size`` points; None where
    the kernel does not take it (fp16 rounding, an axis ``size`` does not divide, TE's 16 signs
    at 32 points) and the reference runs, with its results or its errors."""
    rule = _fused_rotation_rule(x, axis, size, hadamard)
    if rule is None:
        _warn_reference()
        return None
    random = hadamard is not None and HadamardSigns.parse(hadamard) is HadamardSigns.RANDOM
    return rule, (_kernel_seed(hadamard_seed) if random else 0)


def _fused_rotation_rule(x: torch.Tensor, axis: int, size: int, hadamard: str | HadamardSigns | None) -> int | None:
    """_fused_rotation's rule, from x's shape and dtype: the kernel's HADAMARD rule (NO_ROTATION
    where none is asked), or None where it does not take the rotation."""
    if hadamard is None:
        return NO_ROTATION.value
    signs = HadamardSigns.parse(hadamard)
    if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[axis] % size or (
            signs is HadamardSigns.TE and size != len(TE_SIGNS)):
        return None
    return HADAMARD_RULES[signs]


def _warn_reference() -> None:
    from . import _warn_once
    _warn_once("fp4lab.kernels: the fused Hadamard quantize covers float32/bfloat16 inputs whose block axis "
               "is a multiple of the rotation size; this call runs the (slower) reference")


# (BM, BK, warps) of block_values_pair. Swept on an H100 (benchmarks/sweep_quantize.py, x 8192 x 4096
# with RHT for wgrad): 64 x 32 with 4 warps 0.285 ms, the best of seven; 64 x 64 0.342 ms
PAIR_TILE = (64, 32, 4)
# tiles a program takes down the rows, per pass (amax, copies): at most PAIR_ITERS, halved while the
# grid would fall under PAIR_PROGRAMS programs (several per SM on an H100: the pass fills the device).
# benchmarks/sweep_pair.py on an H100 (d20b1ca; random signs): (8, 1) against (1, 1) took the x pair
# at 16384 x 2304 from 158.4 to 149.1 us, dy from 209.8 to 200.5 (768 wide: 58.2 -> 56.9, 77.1 ->
# 75.8); looping the copies' pass too was slower (summed over the shapes: 2 tiles +6%, 4 tiles +10%
# against one): that pass is register-bound at 44-50% occupancy, and a program's tiles run in turn
PAIR_ITERS, PAIR_PROGRAMS = (8, 1), 1024
# registers a thread, per pass (amax, copies): None leaves it to the compiler. A cap on the copies'
# pass (64-67 registers, half occupancy) did not pay on an H100 (62cfe28; the sweep's shapes summed):
# +0.4% at 56, +0.9% at 48, +8.2% at 40 against none (benchmarks/sweep_pair.py)
PAIR_MAXNREG = (None, None)


_PAIR_KEYWORDS = frozenset({"rounding", "seed", "profile", "mode", "block", "pad", "hadamard", "hadamard_seed"})
_PER_CALL = ("seed", "hadamard_seed")  # (the keywords whose values differ call by call: not in a plan)


def pair_refusal(x: torch.Tensor, fmt: Format, rows: dict, columns: dict, columns_len: int) -> str | None:
    """Why block_values_pair does not cover a call (the caller quantizes the copies one by one),
    or None: a 2D bf16/fp32 matrix with no empty axis, K and the padded rows multiples of the
    block, 1-row blocks, no rotation of the rows copy, TE's signs at 16 points only."""
    plan = _pair_plan(x, fmt, rows, columns, columns_len)
    return plan if isinstance(plan, str) else None


def _refusal(shape: tuple[int, ...], dtype: torch.dtype, fmt: Format, rows: dict, columns: dict,
             columns_len: int) -> str | None:
    """pair_refusal's rule, from x's shape and dtype."""
    size = 16 if fmt is Format.NVFP4 else MX_BLOCK
    for copy, kw in enumerate((rows, columns)):
        block = _nvfp4_block(kw.get("block", 16)) if fmt is Format.NVFP4 else (1, MX_BLOCK)
        if set(kw) - _PAIR_KEYWORDS or block != (1, size) or (copy == 0 and kw.get("hadamard") is not None):
            return f"1-row blocks and no rotation of the rows copy, got {kw}"
    signs = columns.get("hadamard")
    if (len(shape) != 2 or dtype not in (torch.bfloat16, torch.float32) or 0 in shape or shape[1] % size
            or columns_len < shape[0] or columns_len % size
            or (signs is not None and HadamardSigns.parse(signs) is HadamardSigns.TE and size != 16)):
        return (f"x {tuple(shape)} {dtype} with {columns_len} column-copy rows (bf16/fp32, no empty axis, K "
                f"and the padded rows multiples of {size}, TE's signs at 16 points)")
    return None


def block_values_pair(x: torch.Tensor, fmt: Format, *, rows: dict, columns: dict, columns_len: int
                      ) -> tuple[BlockValues, BlockValues]:
    """The two copies a linear layer quantizes of one tensor (its input for fprop and wgrad, its
    output gradient for dgrad and wgrad), each read of x serving both.

    x: [M, K] bf16/fp32 row-major, K a multiple of the block -> (the rows copy: what
    ``<fmt>_block_values(x, axis=1, **rows)`` gives, the columns copy: what
    ``<fmt>_block_values(xp, axis=0, **columns)`` gives for x zero-padded to ``columns_len`` rows).
    Keywords: rounding, seed, profile (NVFP4) or mode (MXFP4), block (1-row blocks only); the
    columns copy also hadamard and hadamard_seed. Seeds may be device tensors. Two launches for
    NVFP4 (one pass for both tensor amaxes, one for both copies), one for MXFP4."""
    pair = try_block_values_pair(x, fmt, rows=rows, columns=columns, columns_len=columns_len)
    if pair is None:
        raise ValueError(f"block_values_pair: {pair_refusal(x, fmt, rows, columns, columns_len)}")
    return pair


class _PairPlan:
    """What a pair launch takes from its call's shape, dtype and keywords (seeds aside): worked out
    once per such call (an FP4 linear makes the same two calls every step) and kept, with its
    launches' kernels bound to their constexprs (per pass, and per which seeds are device tensors)."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, fmt: Format, rows: dict, columns: dict,
                 columns_len: int) -> None:
        self.nvfp4 = fmt is Format.NVFP4
        rules = [NV_RULES[NVFP4Profile.parse(kw.get("profile", NVFP4Profile.TE))] if self.nvfp4
                 else MX_RULES[MXScaleMode.parse(kw.get("mode", MXScaleMode.FLOOR))] for kw in (rows, columns)]
        self.roundings = [Rounding.parse(kw.get("rounding", Rounding.RTNE)) for kw in (rows, columns)]
        signs = columns.get("hadamard")
        self.signs = None if signs is None else HadamardSigns.parse(signs)
        self.bf16 = dtype == torch.bfloat16
        bm, bk, warps = PAIR_TILE
        m, k = shape
        self._tiles = (cdiv(columns_len, bm), cdiv(k, bk))
        self.iters = tuple(self._iters(most) for most in PAIR_ITERS)  # (the amax pass, the copies' pass)
        self.registers = tuple({} if n is None else {"maxnreg": n} for n in PAIR_MAXNREG)
        self.options = dict(RULE_R=rules[0], RULE_C=rules[1], BLOCK=16 if self.nvfp4 else MX_BLOCK,
                            STOCHASTIC_R=self.roundings[0] is Rounding.STOCHASTIC,
                            STOCHASTIC_C=self.roundings[1] is Rounding.STOCHASTIC,
                            HADAMARD_C=NO_ROTATION.value if self.signs is None else HADAMARD_RULES[self.signs],
                            BF16_BITS=self.bf16, BM=bm, BK=bk, num_warps=warps, enable_fp_fusion=False)
        self._passes: dict[tuple[bool, bool, bool], tuple] = {}

    def _iters(self, most: int) -> int:
        """Tiles a program: a power of two up to ``most``, doubled while the grid keeps PAIR_PROGRAMS
        programs."""
        iters = 1
        while 2 * iters <= most and cdiv(self._tiles[0], 2 * iters) * self._tiles[1] >= PAIR_PROGRAMS:
            iters *= 2
        return iters

    def grid(self, iters: int) -> tuple[int, int]:
        """The launch grid of a pass whose programs take ``iters`` tiles each."""
        return cdiv(self._tiles[0], iters), self._tiles[1]

    def passes(self, in_memory: tuple[bool, bool, bool], partners: tuple[bool, bool] = (False, False)) -> tuple:
        """The launches, in order (NVFP4: the amax pass, then the copies' pass), as (bound kernel,
        grid), for seeds in memory as ``in_memory`` says (rows, columns, the columns' rotation),
        and the copies' alphas written where ``partners`` says (rows, columns)."""
        bound = self._passes.get((in_memory, partners))
        if bound is None:
            flags = dict(SEED_R_IN_MEMORY=in_memory[0], SEED_C_IN_MEMORY=in_memory[1], H_SEED_IN_MEMORY=in_memory[2],
                         PARTNER_R=partners[0], PARTNER_C=partners[1])
            bound = self._passes[(in_memory, partners)] = tuple(
                (_fp4_pair_kernel.bind(**self.options, AMAX_ONLY=amax_only, ITERS=self.iters[not amax_only], **flags,
                                       **self.registers[not amax_only]),
                 self.grid(self.iters[not amax_only]))
                for amax_only in ((True, False) if self.nvfp4 else (False,)))
        return bound


_PAIR_PLANS = PlanTable(256)  # key -> _PairPlan (accepted calls only)


def _pair_plan(x: torch.Tensor, fmt: Format, rows: dict, columns: dict, columns_len: int) -> _PairPlan | str:
    """The call's _PairPlan, or why the pair kernel does not cover it (pair_refusal)."""
    shape = tuple(x.shape)
    try:
        key = (fmt, shape, x.dtype, columns_len, PAIR_TILE, PAIR_ITERS, PAIR_PROGRAMS, PAIR_MAXNREG,
               *((k, v) for k, v in rows.items() if k not in _PER_CALL),
               None, *((k, v) for k, v in columns.items() if k not in _PER_CALL))
        plan = _PAIR_PLANS.get(key)
    except TypeError:  # an unhashable keyword value: worked out afresh
        key = plan = None
    if plan is None:
        refusal = _refusal(shape, x.dtype, fmt, rows, columns, columns_len)
        if refusal:  # (not kept: a refused call's keywords may hold anything, tensors included)
            return refusal
        plan = _PairPlan(shape, x.dtype, fmt, rows, columns, columns_len)
        if key is not None:
            _PAIR_PLANS.keep(key, plan)
    return plan


def try_block_values_pair(x: torch.Tensor, fmt: Format, *, rows: dict, columns: dict, columns_len: int,
                          partners: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
                          ) -> tuple[BlockValues, BlockValues] | None:
    """block_values_pair, or None where pair_refusal refuses the call (one plan lookup answers both).
    ``partners``: for each copy (rows, columns), None or the [] fp32 tensor scale of the operand
    its GEMM multiplies it with (NVFP4): the copy's BlockValues then carries the product,
    written by the copies' pass (BlockValues.alpha_with)."""
    plan = _pair_plan(x, fmt, rows, columns, columns_len)
    if isinstance(plan, str):
        return None
    has = (partners[0] is not None and plan.nvfp4, partners[1] is not None and plan.nvfp4)
    for partner, used in zip(partners, has):
        if used and (partner.numel() != 1 or partner.dtype != torch.float32 or partner.device != x.device):
            raise ValueError(f"a pair's partner tensor scale must be one fp32 value on {x.device}, got "
                             f"{tuple(partner.shape)} {partner.dtype} on {partner.device}")
    # seeds resolved in the two calls' order (rows; then the columns' rotation, then their rounding),
    # so a generator or None draws what the two calls would draw
    seed_r = _seed(plan.roundings[0], rows.get("seed"))
    h_seed = _kernel_seed(columns.get("hadamard_seed")) if plan.signs is HadamardSigns.RANDOM else 0
    seeds = (seed_r, _seed(plan.roundings[1], columns.get("seed")), h_seed)
    x = x.contiguous()
    m, k = x.shape
    device = x.device
    rows_v = torch.empty(m, k, dtype=torch.int16, device=device)
    cols_v = torch.empty(k, columns_len, dtype=torch.int16, device=device)
    # NVFP4: both tensor amaxes (zeroed: the first pass takes atomic maxima) and both S_dec
    amax = zeroed_int32(2, device) if plan.nvfp4 else rows_v
    # written by the kernel: both S_dec, then the alphas asked for
    s_dec = torch.empty(4 if any(has) else 2, dtype=torch.float32, device=device) if plan.nvfp4 else rows_v
    in_memory = (isinstance(seeds[0], torch.Tensor), isinstance(seeds[1], torch.Tensor),
                 isinstance(seeds[2], torch.Tensor))
    ints = [0 if mem else v for v, mem in zip(seeds, in_memory)]
    ptrs = [v if mem else rows_v for v, mem in zip(seeds, in_memory)]
    partner_ptrs = [p if used else 0 for p, used in zip(partners, has)]  # (0: never read)
    src = x.view(torch.int16) if plan.bf16 else x
    for kernel, grid in plan.passes(in_memory, has):
        kernel[grid](src, rows_v, cols_v, amax, s_dec, *ints, *ptrs, *partner_ptrs, m, k, columns_len, k)
    if not plan.nvfp4:
        return (BlockValues(rows_v.view(torch.bfloat16), None, m, fmt),
                BlockValues(cols_v.view(torch.bfloat16), None, k, fmt))
    slots = s_dec.unbind()  # (one call for every view: indexing costs a call each)
    alphas = [(slots[i], p, slots[2 + i]) if used else None for i, (p, used) in enumerate(zip(partners, has))]
    return (BlockValues(rows_v.view(torch.bfloat16), slots[0], m, fmt, alphas[0]),
            BlockValues(cols_v.view(torch.bfloat16), slots[1], k, fmt, alphas[1]))


def _group_seeds(seeds: list[int] | torch.Tensor, draws: bool, stand_in: torch.Tensor) -> torch.Tensor:
    """G seeds where a grouped launch reads them, with no host-to-device copy where it can do
    without (what a CUDA graph captures): a tensor of kernel seeds is used as it is (a SeedTable's
    slots, refilled before each replay); a launch that draws nothing reads ``stand_in`` (an int64
    table of the launch's own, G entries or more), whose values it never uses: no fill; other
    lists of ints are copied over (eager runs)."""
    device = stand_in.device
    if isinstance(seeds, torch.Tensor):
        if seeds.dim() != 1 or seeds.dtype != torch.int64 or seeds.device != device:
            raise ValueError(f"seeds as a tensor must be int64 kernel seeds on {device}, got {tuple(seeds.shape)} "
                             f"{seeds.dtype} on {seeds.device}")
        return seeds
    if not draws:
        return stand_in
    if len(set(seeds)) == 1:  # one seed for all (fixed random signs): a fill, no copy either
        return torch.full((len(seeds),), _kernel_seed(seeds[0]), dtype=torch.int64, device=device)
    return torch.tensor([_kernel_seed(v) for v in seeds], dtype=torch.int64).to(device, non_blocking=True)


def grouped_block_values(x: torch.Tensor, fmt: Format, sizes: list[int] | torch.Tensor,
                         seeds: list[int] | torch.Tensor, *,
                         block: int | tuple[int, int] = 16, rounding: str | Rounding = Rounding.RTNE,
                         profile: str | NVFP4Profile = NVFP4Profile.TE, mode: str | MXScaleMode = MXScaleMode.FLOOR,
                         pad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [R, L] bf16/fp32, groups of ``sizes`` rows back to back (each > 0; a multiple of 16 for
    16x16 blocks), one seed per group -> (values [R, Lp] bf16, S_dec [G] fp32 or None for MXFP4):
    group g's rows are block_values of quantizing it alone along L with seed ``seeds[g]``.
    ``sizes`` may be a tensor on x's device (a routing's counts, never read on the host: a CUDA
    graph can capture the launch), where groups may be empty; then ``seeds`` may be one too
    (_group_seeds), and the blocks are 1 x n (16x16 tiles need their groups' sizes checked)."""
    rounding = Rounding.parse(rounding)
    block2 = _nvfp4_block(block) if fmt is Format.NVFP4 else (1, MX_BLOCK)
    check_input(x, 1, block2, pad)
    if isinstance(sizes, torch.Tensor):
        counts = device_counts(sizes, len(seeds), x.device, "sizes")
        if x.dim() != 2 or x.shape[1] == 0 or block2[0] > 1:
            raise ValueError(f"grouped_block_values: device counts take x [R, L > 0] in 1 x n blocks, got x "
                             f"{tuple(x.shape)}, blocks {block2}")
        starts = groups.edges(counts, x.shape[0])[0]  # (negative counts read as 0, as the GEMM reads them)
        seeds_t = _group_seeds(seeds, rounding is Rounding.STOCHASTIC, starts)
        return _grouped_rows(x.contiguous(), fmt, starts, seeds_t, block2, rounding, profile, mode, pad)
    if x.dim() != 2 or x.shape[1] == 0 or len(sizes) != len(seeds) or sum(sizes) != x.shape[0] or min(sizes, default=1) <= 0 or (
            block2[0] > 1 and any(n % block2[0] for n in sizes)):
        raise ValueError(f"grouped_block_values: x {tuple(x.shape)} does not split into groups of {list(sizes)} "
                         f"rows (each > 0{', a multiple of 16' if block2[0] > 1 else ''}), {len(seeds)} seeds")
    x = x.contiguous()
    uniform = len(set(sizes)) == 1
    if isinstance(seeds, torch.Tensor) or (uniform and rounding is not Rounding.STOCHASTIC):
        # device seeds, or none drawn: groups of one size (an MoE projection's weights) start
        # where a device op puts them, no copy (a CUDA graph can capture it)
        starts = (torch.arange(len(sizes), dtype=torch.int64, device=x.device) * sizes[0] if uniform else
                  torch.tensor([0, *itertools.accumulate(sizes)][:-1], dtype=torch.int64).to(x.device, non_blocking=True))
        seeds_t = _group_seeds(seeds, rounding is Rounding.STOCHASTIC, starts)
        return _grouped_rows(x, fmt, starts, seeds_t, block2, rounding, profile, mode, pad)
    sizes_t = torch.tensor(sizes, dtype=torch.int64)
    # one copy to the device: the groups' first rows, then their seeds
    meta = torch.cat([sizes_t.cumsum(0) - sizes_t,
                      torch.tensor([_seed(rounding, s) for s in seeds], dtype=torch.int64)]).to(x.device, non_blocking=True)
    return _grouped_rows(x, fmt, meta[: len(sizes)], meta[len(sizes):], block2, rounding, profile, mode, pad)


def _grouped_rows(x, fmt, starts, seeds_t, block2, rounding, profile, mode, pad):
    """grouped_block_values' launches, given the groups' first rows and seeds on the device."""
    grouped = (starts, seeds_t, seeds_t, starts.numel())
    stochastic = rounding is Rounding.STOCHASTIC
    if fmt is Format.NVFP4:
        amax = grouped_finite_amax(x, starts).view(torch.int32)
        s_dec = torch.empty(starts.numel(), dtype=torch.float32, device=x.device)  # written by the kernel
        rule = NV_RULES[NVFP4Profile.parse(profile)]
        values, _, _ = _launch(x, 1, block2, pad, rule, amax, s_dec, stochastic, 0, out_values=True, grouped=grouped,
                               group_mode=ROW_GROUPS.value)
        return values.view(torch.bfloat16), s_dec
    values, _, _ = _launch(x, 1, block2, pad, MX_RULES[MXScaleMode.parse(mode)], None, None, stochastic, 0,
                           out_values=True, grouped=grouped, group_mode=ROW_GROUPS.value)
    return values.view(torch.bfloat16), None


def grouped_column_block_values(x: torch.Tensor, fmt: Format, widths: list[int] | torch.Tensor,
                                seeds: list[int] | torch.Tensor, *,
                                block: int | tuple[int, int] = 16, rounding: str | Rounding = Rounding.RTNE,
                                profile: str | NVFP4Profile = NVFP4Profile.TE,
                                mode: str | MXScaleMode = MXScaleMode.FLOOR, hadamard: str | HadamardSigns | None = None,
                                hadamard_seeds: list[int] | torch.Tensor | None = None,
                                rows: list[int] | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [S, K] bf16/fp32, groups of ``widths`` rows back to back (each a positive multiple of
    32: wgrad's token axis, padded per MoE expert) -> (values [K, S] bf16, S_dec [G] fp32 or None):
    the columns of group g are block_values of quantizing its rows alone along axis 0 (1x16 or
    1x32 blocks) with seed ``seeds[g]``, rotated first when asked (``hadamard_seeds[g]`` for
    random signs). One launch for the amax of every group (NVFP4), one for the values. ``widths``
    may be a tensor on x's device (each expert's padded token count, never read on the host: a
    CUDA graph can capture the launches; widths of 0 allowed), and the seeds then too, as in
    grouped_block_values.

    ``rows`` (host ints, or a device tensor where ``widths`` is one): x holds each group's rows
    unpadded, rows[g] <= widths[g] of them back to back, and the launches read them where the
    padded layout puts them, its padding as zeros: the same bytes with no padded copy of x. The
    padded length is sum(widths), or with device counts the most any split needs, S + 31 G
    rounded up to 32 (what nn's wgrad multiplies)."""
    rounding = Rounding.parse(rounding)
    size = 16 if fmt is Format.NVFP4 else MX_BLOCK
    check_input(x, 0, (1, size), rows is not None)  # unpadded groups: any number of rows
    signs = None if hadamard is None else HadamardSigns.parse(hadamard)
    if fmt is Format.NVFP4 and _nvfp4_block(block) != (1, 16):
        raise ValueError(f"grouped_column_block_values takes 1x16 NVFP4 blocks, got {block}")
    on_device = isinstance(widths, torch.Tensor)
    if rows is not None:
        from . import check_unpadded_rows
        check_unpadded_rows(x.shape[0], rows, widths)
    if on_device:
        widths = device_counts(widths, len(seeds), x.device, "widths")
        if rows is not None:
            rows = device_counts(rows, len(seeds), x.device, "rows")
    padded = x.shape[0] if rows is None else (
        cdiv(x.shape[0] + (COL_GROUP_WIDTH - 1) * len(widths), COL_GROUP_WIDTH) * COL_GROUP_WIDTH if on_device
        else sum(widths))
    if (x.dim() != 2 or x.shape[1] == 0 or len(widths) != len(seeds) or not on_device and (
            sum(widths) != padded or any(w <= 0 or w % COL_GROUP_WIDTH for w in widths)) or (signs is not None and (
                x.dtype not in (torch.float32, torch.bfloat16) or (signs is HadamardSigns.TE and size != 16)))):
        raise ValueError(f"grouped_column_block_values: x {tuple(x.shape)} {x.dtype} does not split into groups "
                         f"of {list(widths)} rows (each a positive multiple of {COL_GROUP_WIDTH}) with "
                         f"{len(seeds)} seeds and rotation {hadamard}")
    x = x.contiguous()
    g = len(widths)
    h_seeds = [0] * g if hadamard_seeds is None else hadamard_seeds
    if on_device or isinstance(seeds, torch.Tensor) or isinstance(h_seeds, torch.Tensor):
        # device counts or seeds (a SeedTable's slots): kept there, the edges made (one launch) or copied once
        if on_device:
            edges, source = groups.column_edges(widths, rows)
        else:
            edges = torch.tensor([0, *itertools.accumulate(widths)], dtype=torch.int64).to(x.device, non_blocking=True)
        grouped = (edges, _group_seeds(seeds, rounding is Rounding.STOCHASTIC, edges),
                   _group_seeds(h_seeds, signs is HadamardSigns.RANDOM, edges), g)
    else:
        widths_t = torch.tensor(widths, dtype=torch.int64)
        h_seeds = [_kernel_seed(h) if signs is HadamardSigns.RANDOM else 0 for h in h_seeds]
        meta = torch.cat([torch.cat([torch.zeros(1, dtype=torch.int64), widths_t.cumsum(0)]),
                          torch.tensor([_seed(rounding, s) for s in seeds] + h_seeds, dtype=torch.int64)]
                         ).to(x.device, non_blocking=True)  # no stream sync, as matmul's tile lists
        grouped = (meta[: g + 1], meta[g + 1: 2 * g + 1], meta[2 * g + 1:], g)
    src = None if rows is None else (source if on_device else _source_groups(widths, rows, x.device), padded)
    rotation = NO_ROTATION.value if signs is None else HADAMARD_RULES[signs]
    stochastic = rounding is Rounding.STOCHASTIC
    if fmt is Format.NVFP4:
        amax = zeroed_int32(g, x.device)
        _launch(x, 0, (1, 16), False, NV_TE.value, amax, None, False, 0, rotation, 0, amax_only=True, grouped=grouped,
                group_mode=COL_GROUPS.value, src_groups=src)
        s_dec = torch.empty(g, dtype=torch.float32, device=x.device)  # written by the kernel
        values, _, _ = _launch(x, 0, (1, 16), False, NV_RULES[NVFP4Profile.parse(profile)], amax, s_dec, stochastic,
                               0, rotation, 0, out_values=True, grouped=grouped, group_mode=COL_GROUPS.value,
                               src_groups=src)
        return values.view(torch.bfloat16), s_dec
    values, _, _ = _launch(x, 0, (1, MX_BLOCK), False, MX_RULES[MXScaleMode.parse(mode)], None, None, stochastic, 0,
                           rotation, 0, out_values=True, grouped=grouped, group_mode=COL_GROUPS.value, src_groups=src)
    return values.view(torch.bfloat16), None


def _source_groups(widths: list[int], rows: list[int], device: torch.device) -> torch.Tensor:
    """[2 G] int64 on the device: each group's shift from the padded layout back to x (its first
    padded row minus its first row in x), then its row count (device counts: groups.column_edges)."""
    shifts = list(itertools.accumulate((w - n for w, n in zip(widths, rows)), initial=0))[:-1]  # padding before g
    return torch.tensor(shifts + list(rows), dtype=torch.int64).to(device, non_blocking=True)


def _logical_rows(x: torch.Tensor, axis: int) -> int:
    """Rows of the stored layout that hold data (16x16 tiles pad the rest)."""
    return math.prod(size for i, size in enumerate(x.shape) if i != axis)
