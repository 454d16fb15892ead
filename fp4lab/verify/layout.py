"""check_layout: does a scale swizzle put every byte where the 128x4 layout says, padding included,
and does the unswizzle invert it?

The layout (formats.layout, docs/numerics.md "Scale-factor layout"): scales S [rows, cols] are zero-padded to Rp = 128 *
ceil(rows / 128), Kp = 4 * ceil(cols / 4), and byte (m, k) goes to

    offset(m, k) = ((m // 128) * (Kp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4

Method: fill S with position-encoded bytes, digit d of position p = m * cols + k stored as
1 + (p // 255^d) % 255 (never 0, so padding stays recognisable; one digit suffices up to 255
positions, two up to 65025), swizzle each digit plane with ``remap``, and decode every offset of
the result back to the position whose byte it holds. Each source position must appear exactly
at ``swizzled_offset``; every other offset must be 0. The inverse is checked on the true buffer
(built by scattering S to ``swizzled_offset``), so neither direction is tested against itself.

Rungs, per shape: ``size`` (Rp * Kp bytes), ``placement``, ``padding``, ``inverse``.

Public: ``check_layout``, ``describe_offset``, ``DEFAULT_ROWS``, ``DEFAULT_COLS``.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Callable, Sequence

import torch

from ..formats import swizzle_scales, swizzled_offset, unswizzle_scales
from ..formats.layout import _padded
from .result import CheckResult

DEFAULT_ROWS = (1, 31, 128, 130, 257)
DEFAULT_COLS = (1, 3, 4, 7)
BASE = 255


def describe_offset(offset: int, cols: int) -> dict[str, int]:
    """A swizzled byte offset -> its fields, and the (row, col) the layout assigns to it."""
    kp = _padded(1, cols)[1]
    tile, inner = divmod(offset, 512)
    row_tile, col_group = divmod(tile, kp // 4)
    row_in_slab, rest = divmod(inner, 16)
    slab, col_in_group = divmod(rest, 4)
    return dict(offset=offset, row_tile=row_tile, col_group=col_group, row_in_slab=row_in_slab, slab=slab,
                col_in_group=col_in_group, row=row_tile * 128 + slab * 32 + row_in_slab,
                col=col_group * 4 + col_in_group)


def _planes(rows: int, cols: int) -> list[torch.Tensor]:
    """Position-encoded [rows, cols] uint8 digit planes."""
    pos = torch.arange(rows * cols).reshape(rows, cols)
    digits = max(1, math.ceil(math.log(rows * cols, BASE))) if rows * cols > 1 else 1
    return [(1 + (pos // BASE ** d) % BASE).to(torch.uint8) for d in range(digits)]


def _decode(buffers: list[torch.Tensor]) -> torch.Tensor:
    """Digit planes of a buffer -> position per offset; -1 where all digits are 0, -2 for garbage."""
    stack = torch.stack([b.to(torch.int64) for b in buffers])  # [digits, size]
    zero = stack == 0
    weights = torch.tensor([BASE ** d for d in range(len(buffers))])[:, None]
    pos = ((stack - 1) * weights).sum(0)
    return torch.where(zero.all(0), -1, torch.where(zero.any(0), -2, pos))


def _as_bytes(buffer, what: str) -> torch.Tensor:
    if not isinstance(buffer, torch.Tensor) or buffer.element_size() != 1:
        raise TypeError(f"{what} must return a tensor of one-byte elements, got "
                        f"{getattr(buffer, 'dtype', type(buffer).__name__)}")
    return buffer.reshape(-1).view(torch.uint8).cpu()


def check_layout(remap: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
                 inverse: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None,
                 rows: int | Sequence[int] = DEFAULT_ROWS, cols: int | Sequence[int] = DEFAULT_COLS) -> CheckResult:
    """Check ``remap(scales: [rows, cols] uint8) -> buffer [Rp * Kp]`` (default formats.swizzle_scales)
    and ``inverse(buffer, rows, cols) -> [rows, cols]`` (default formats.unswizzle_scales) on every
    (rows, cols) shape of the two lists."""
    remap = remap or swizzle_scales
    inverse = inverse or unswizzle_scales
    rows = (rows,) if isinstance(rows, int) else tuple(rows)
    cols = (cols,) if isinstance(cols, int) else tuple(cols)
    if not rows or not cols or min(rows + cols) < 1:
        raise ValueError(f"rows and cols must be positive, got rows={rows}, cols={cols}")
    subject = f"check_layout {getattr(remap, '__name__', 'remap')}"
    for r, c in product(rows, cols):
        failure = _check_shape(remap, inverse, r, c)
        if failure is not None:
            rung, message, details = failure
            return CheckResult(ok=False, rung=rung, message=f"[{r}, {c}] scales: {message}",
                               details={"rows": r, "cols": c, **details}, subject=subject)
    shapes = [f"{r}x{c}" for r, c in product(rows, cols)]
    return CheckResult(ok=True, rung=None, message=f"every byte placed, padding zero and inverted on "
                       f"{len(shapes)} shapes", details={"shapes": " ".join(shapes)}, subject=subject)


def _check_shape(remap, inverse, rows: int, cols: int):
    rp, kp = _padded(rows, cols)
    planes = _planes(rows, cols)
    buffers = [_as_bytes(remap(p), "remap") for p in planes]
    if buffers[0].numel() != rp * kp:
        return ("size", f"the buffer has {buffers[0].numel()} bytes, the layout pads to [{rp}, {kp}] = "
                f"{rp * kp}", dict(expected_size=rp * kp, got_size=buffers[0].numel()))
    m, k = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    offsets = swizzled_offset(m, k, cols).reshape(-1)  # [rows * cols], source order
    expected = torch.full((rp * kp,), -1, dtype=torch.int64)
    expected[offsets] = torch.arange(rows * cols)
    held = _decode(buffers)
    if not torch.equal(held[offsets], torch.arange(rows * cols)):
        return _misplaced(held, offsets, cols)
    pad = (expected == -1) & (held != -1)
    if pad.any():
        o = int(pad.nonzero()[0])
        what = "a byte that is no source position" if held[o] == -2 else \
            "the byte of source ({}, {})".format(*divmod(int(held[o]), cols))
        return ("padding", f"padding offset {o} (where ({describe_offset(o, cols)['row']}, "
                f"{describe_offset(o, cols)['col']}) of the padded matrix goes) holds {what}, must be 0; "
                f"{int(pad.sum())} padding bytes nonzero", dict(offset=describe_offset(o, cols),
                                                                byte=int(buffers[0][o]), bad_padding=int(pad.sum())))
    return _check_inverse(inverse, planes, offsets, rows, cols, rp * kp)


def _misplaced(held: torch.Tensor, offsets: torch.Tensor, cols: int):
    wrong = (held[offsets] != torch.arange(offsets.numel())).nonzero().flatten()
    examples = []
    for p in wrong[:4].tolist():
        actual = (held == p).nonzero().flatten().tolist()
        examples.append(dict(source=divmod(p, cols), expected_offset=int(offsets[p]),
                             actual_offsets=actual or "missing",
                             expected=describe_offset(int(offsets[p]), cols),
                             actual=describe_offset(actual[0], cols) if actual else None))
    first = examples[0]
    act = first["actual"]
    where = f"at offset {act['offset']}, the layout's place for ({act['row']}, {act['col']})" if act else "nowhere"
    return ("placement", f"source byte {first['source']} belongs at offset {first['expected_offset']} "
            f"but landed {where}; {wrong.numel()} of {offsets.numel()} bytes misplaced",
            dict(misplaced=wrong.numel(), first=examples))


def _check_inverse(inverse, planes, offsets, rows: int, cols: int, size: int):
    outs = []
    for plane in planes:
        buffer = torch.zeros(size, dtype=torch.uint8)
        buffer[offsets] = plane.reshape(-1)
        out = inverse(buffer, rows, cols)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows, cols):
            return ("inverse", f"the inverse must return [{rows}, {cols}], got "
                    f"{tuple(getattr(out, 'shape', ()))}", {})
        outs.append(_as_bytes(out, "inverse"))
    got = _decode(outs)
    wrong = (got != torch.arange(rows * cols)).nonzero().flatten()
    if wrong.numel() == 0:
        return None
    p = int(wrong[0])
    src = f"source {divmod(int(got[p]), cols)}" if got[p] >= 0 else "a byte of no source position"
    return ("inverse", f"unswizzle put {src} at {divmod(p, cols)} (its byte sits at offset {int(offsets[p])}); "
            f"{wrong.numel()} positions wrong", dict(position=divmod(p, cols), offset=int(offsets[p]),
                                                     wrong=wrong.numel()))
