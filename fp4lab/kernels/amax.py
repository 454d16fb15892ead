"""Triton tensor amax over finite values (formats.blocks.finite_amax), as its own fast pass.

A persistent grid (a few programs per SM) walks the tensor in chunks, so only a few hundred
programs fold their result in, with an atomic max on the fp32 bit pattern: non-negative floats
order like their int32 bits, and max is order-independent, so the result is deterministic and
exactly the reference's.

``grouped_finite_amax`` gives one amax per group of rows (MoE experts' tensors back to back):
each program reduces its tile's rows and folds them into their group's slot: one atomic where the
tile lies in one group, one per row where it straddles groups.

Public: ``finite_amax`` (and ``finite_amax_bits``, its int32 bits), ``grouped_finite_amax``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .elements import finite_key, group_of, key_bits, widen
from .host import cdiv, sm_count, zeroed_int32
from .launch import cached

GROUPED_TILE = (32, 128)  # (rows, columns) per program of the grouped pass
# the tensor-wide pass: elements a program reads per iteration, programs per SM, warps a program
# (benchmarks/sweep_amax.py times others; any of them gives the same bits: max is order-free)
AMAX_LAUNCH = (2048, 4, 4)


@cached  # (launched through kernels.launch)
@triton.jit
def _finite_amax_kernel(x_ptr, out_ptr, n, chunk, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * chunk
    acc = tl.zeros((BLOCK,), dtype=tl.uint32)
    for i in tl.range(0, chunk, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        x = widen(tl.load(x_ptr + offs, mask=offs < n, other=0), BF16_BITS)
        acc = tl.maximum(acc, finite_key(x))  # (NaN and Inf key below every finite value)
    tl.atomic_max(out_ptr, key_bits(tl.max(acc, axis=0)))


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """x: [...] float -> [] float32 max |x| over finite elements (0 when there are none)."""
    return _finite_amax(x, torch.zeros(1, dtype=torch.int32, device=x.device)).view(torch.float32).reshape(())


def finite_amax_bits(x: torch.Tensor) -> torch.Tensor:
    """finite_amax as fp4lab's quantize kernels read it: [1] int32, the float's bits, in a slot of
    host.zeroed_int32's pool (no fill launch, no views made)."""
    return _finite_amax(x, zeroed_int32(1, x.device))


def _finite_amax(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x's finite amax as int32 bits, taken by atomic maxima into ``out`` ([1] int32 zeros)."""
    flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
    if flat.numel():
        block, per_sm, warps = AMAX_LAUNCH
        programs = per_sm * sm_count(x.device)
        chunk = cdiv(cdiv(flat.numel(), programs), block) * block
        bf16 = flat.dtype == torch.bfloat16
        _finite_amax_kernel[(cdiv(flat.numel(), chunk),)](flat.view(torch.int16) if bf16 else flat, out,
                                                                 flat.numel(), chunk, BF16_BITS=bf16, BLOCK=block,
                                                                 num_warps=warps)
    return out


@cached  # (launched through kernels.launch)
@triton.jit
def _grouped_amax_kernel(x_ptr, out_ptr, start_ptr, n_groups, R, L, BF16_BITS: tl.constexpr, BR: tl.constexpr,
                         BC: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    keys = tl.zeros((BR,), dtype=tl.uint32)
    for c in tl.range(0, L, BC):
        cols = c + tl.arange(0, BC)
        x = widen(tl.load(x_ptr + rows[:, None] * L + cols[None, :], mask=(rows[:, None] < R) & (cols[None, :] < L),
                          other=0), BF16_BITS)
        keys = tl.maximum(keys, tl.max(finite_key(x), axis=1))
    acc = key_bits(keys)
    live = rows < R
    group = group_of(rows, start_ptr, n_groups)
    first, last = tl.min(tl.where(live, group, n_groups)), tl.max(tl.where(live, group, -1))
    if first == last:  # the tile inside one group (most tiles: an expert has hundreds of rows): one
        tl.atomic_max(out_ptr + first, tl.max(tl.where(live, acc, 0)))  # atomic, not one per row on
    else:  # the same slot, which serialised this pass at 0.2-0.3 of copy bandwidth (NOTES.md, 2026-11-26)
        tl.atomic_max(out_ptr + group, acc, mask=live)


def grouped_finite_amax(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """x: [R, L] float, starts: [G] int64 first row of each group (ascending, on x's device) ->
    [G] float32: max |x| over each group's finite elements (0 for none, or an empty group)."""
    x = x.contiguous()
    out = torch.zeros(starts.numel(), dtype=torch.int32, device=x.device)
    if x.numel():
        br, bc = GROUPED_TILE
        bf16 = x.dtype == torch.bfloat16
        _grouped_amax_kernel[(cdiv(x.shape[0], br),)](x.view(torch.int16) if bf16 else x, out, starts,
                                                            starts.numel(), x.shape[0], x.shape[1],
                                                            BF16_BITS=bf16, BR=br, BC=bc)
    return out.view(torch.float32)
