"""A routing's counts, kept on the device, turned into what the grouped launches read: one launch each.

A grouped FP4 call whose counts stay on the device (a CUDA graph captures it; nothing is read on
the host) needs small tables made from them: the groups' first and last rows, the GEMM's tile
list, the padded column groups of wgrad. Made with torch ops each was a chain of five to twenty
launches of a few elements (cumsum, clamp, cat, searchsorted, casts): about 380 launches an MoE
layer's step, a sixth of a captured moe64 step's kernels and 2.7 ms of its GPU time
(benchmarks/NOTES.md, twenty-sixth session). Here each table is one single-program Triton launch
of a program or a few that hold the G counts in registers (cumulative sums by ``tl.cumsum``; a tile's group by
counting the tile ends at or below it, the searchsorted the list needs).

    edges(counts, total)              -> [2, G] int64 (starts, ends): groups back to back, negative
                                         counts read as 0, every edge clamped to ``total``
    segments(counts, total)           -> [2, G] int32 (starts, widths): the same edges, as the
                                         contraction kernel reads them
    tiles(sizes, rows, bm)            -> (group [T], row [T], ends [G]) int32: the grouped GEMM's
                                         tile list for any split of ``rows`` (T = (rows + G (bm - 1)) // bm)
    column_edges(widths, rows=None)   -> ([G + 1] int64 edges 0, w0, w0 + w1, ..., [2 G] int64 or
                                         None): padded column groups, and each group's shift back to
                                         unpadded rows then its row count (as read in place)

Each returns the tensors the torch expressions in its docstring give, for any counts whose running
sums fit int64 (the tests hold them to those expressions, wrong counts included), of any stride
(read through a contiguous copy where they are not contiguous). The counts are trusted: nothing
here is read on the host.

Public: ``edges``, ``segments``, ``tiles``, ``column_edges``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cached


def _lanes(groups: int) -> int:
    return max(16, triton.next_power_of_2(groups))


# (helpers take loaded values, not pointers: torch's analysis of a traced kernel counts a pointer
# handed to a helper that returns a tuple as written)
@triton.jit
def _clamped_edges(counts, total):
    """(starts, ends) int64 of groups of ``counts`` back to back, negatives read as 0."""
    c = tl.maximum(counts.to(tl.int64), 0)
    run = tl.cumsum(c, 0)
    return tl.minimum(run - c, total), tl.minimum(run, total)


@cached  # (launched through kernels.launch)
@triton.jit
def _edges_kernel(counts_ptr, out_ptr, G, total, SEGMENTS: tl.constexpr, BG: tl.constexpr):
    g = tl.arange(0, BG)
    live = g < G
    starts, ends = _clamped_edges(tl.load(counts_ptr + g, mask=live, other=0), total)
    if SEGMENTS:
        tl.store(out_ptr + g, starts.to(tl.int32), mask=live)
        tl.store(out_ptr + G + g, (ends - starts).to(tl.int32), mask=live)
    else:
        tl.store(out_ptr + g, starts, mask=live)
        tl.store(out_ptr + G + g, ends, mask=live)


def edges(counts: torch.Tensor, total: int) -> torch.Tensor:
    """counts: [G] int32/int64 on the device -> [2, G] int64 (starts, ends), one launch:

        ends = counts.clamp_min(0).cumsum(0).clamp_max(total); starts = [0, ends[:-1]]"""
    return _edges(counts, total, segments=False)


def segments(counts: torch.Tensor, total: int) -> torch.Tensor:
    """edges(counts, total) as int32 [2, G] (starts, ends - starts), one launch."""
    return _edges(counts, total, segments=True)


def _edges(counts: torch.Tensor, total: int, *, segments: bool) -> torch.Tensor:
    out = torch.empty(2, counts.numel(), dtype=torch.int32 if segments else torch.int64, device=counts.device)
    _edges_kernel[(1,)](counts.contiguous(), out, counts.numel(), total, SEGMENTS=segments, BG=_lanes(counts.numel()))
    return out


@cached  # (launched through kernels.launch)
@triton.jit
def _tiles_kernel(sizes_ptr, group_ptr, row_ptr, ends_ptr, G, rows, bm, T, BG: tl.constexpr, BT: tl.constexpr):
    # each program lists BT tiles (every program sums the G counts again: a few instructions, where
    # one program walking all the tiles took 14 us at moe64's 447)
    g = tl.arange(0, BG)
    live = g < G
    starts, ends = _clamped_edges(tl.load(sizes_ptr + g, mask=live, other=0), rows)
    if tl.program_id(0) == 0:
        tl.store(ends_ptr + g, ends.to(tl.int32), mask=live)
    per = (ends - starts + bm - 1) // bm  # each group's tiles
    tiles_end = tl.cumsum(per, 0)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    # the first group whose tiles end past t (searchsorted, right), the last group past them all
    past = live[None, :] & (tiles_end[None, :] <= t[:, None])
    group = tl.minimum(tl.sum(past.to(tl.int32), 1), G - 1)
    at = g[None, :] == group[:, None]  # (picks each tile's group's entries out of the lanes)
    first = tl.sum(tl.where(at, starts[None, :] - (tiles_end - per)[None, :] * bm, 0), 1)
    last_end = tl.max(tl.where(live, ends, 0), 0)
    row = tl.where(t < tl.sum(per, 0), first + t.to(tl.int64) * bm, last_end)
    tl.store(group_ptr + t, group, mask=t < T)
    tl.store(row_ptr + t, row.to(tl.int32), mask=t < T)


def tiles(sizes: torch.Tensor, rows: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sizes: [G] int32/int64 on the device -> (group, row, ends) int32, one launch: the tile list
    of a grouped GEMM over ``rows`` rows in row tiles of ``bm``, made without reading the sizes.
    sum(ceil(size / bm)) is at most T = (rows + G (bm - 1)) // bm for any G sizes summing to rows,
    so T tiles; tile t belongs to the first group whose tiles end past t, and starts bm rows a
    tile into it; a tile past the last live one gets group G - 1 and the row range of nothing
    (first row = the last end). Sizes are clamped as edges() clamps them, so a wrong count cannot
    make the kernel read outside the rows. In torch:

        starts, ends = edges(sizes, rows); per = (ends - starts + bm - 1) // bm; tiles_end = per.cumsum(0)
        t = arange(T); group = searchsorted(tiles_end, t, right=True).clamp_max(G - 1)
        row = where(t < tiles_end[-1], starts[group] + (t - tiles_end[group] + per[group]) * bm, ends[-1])"""
    n_groups = sizes.numel()
    count = (rows + n_groups * (bm - 1)) // bm
    group, row = torch.empty(2, count, dtype=torch.int32, device=sizes.device)
    ends = torch.empty(n_groups, dtype=torch.int32, device=sizes.device)
    lanes = _lanes(n_groups)
    per_program = max(16, min(128, 8192 // lanes))
    grid = (max(1, triton.cdiv(count, per_program)),)
    _tiles_kernel[grid](sizes.contiguous(), group, row, ends, n_groups, rows, bm, count, BG=lanes, BT=per_program)
    return group, row, ends


@cached  # (launched through kernels.launch)
@triton.jit
def _column_edges_kernel(widths_ptr, rows_ptr, edges_ptr, src_ptr, G, ROWS: tl.constexpr, BG: tl.constexpr):
    g = tl.arange(0, BG)
    live = g < G
    w = tl.load(widths_ptr + g, mask=live, other=0).to(tl.int64)
    run = tl.cumsum(w, 0)
    tl.store(edges_ptr + g, tl.zeros((BG,), dtype=tl.int64), mask=g == 0)
    tl.store(edges_ptr + 1 + g, run, mask=live)
    if ROWS:
        r = tl.load(rows_ptr + g, mask=live, other=0).to(tl.int64)
        tl.store(src_ptr + g, (run - w) - (tl.cumsum(r, 0) - r), mask=live)
        tl.store(src_ptr + G + g, r, mask=live)


def column_edges(widths: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """widths (and rows): [G] int32/int64 on the device -> (edges [G + 1] int64, source [2 G] int64
    or None), one launch: the column groups of a grouped columns quantize, each group's first
    padded row minus its first row in the unpadded x, then its rows. In torch, as given (unclamped):

        edges = cat([0], widths.cumsum(0)); source = cat([(widths.cumsum(0) - widths) - (rows.cumsum(0) - rows), rows])"""
    n_groups = widths.numel()
    out = torch.empty(n_groups + 1 + (0 if rows is None else 2 * n_groups), dtype=torch.int64, device=widths.device)
    edges_, source = out[: n_groups + 1], None if rows is None else out[n_groups + 1:]
    widths = widths.contiguous()
    _column_edges_kernel[(1,)](widths, widths if rows is None else rows.contiguous(), edges_,
                               out if source is None else source, n_groups, ROWS=rows is not None, BG=_lanes(n_groups))
    return edges_, source
