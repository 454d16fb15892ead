"""The swizzled block-scale layout of Blackwell's block-scaled GEMMs (cuBLAS "128x4", CUTLASS
SM100 ``SfKMajorAtom``, torch ``SWIZZLE_32_4_4``), and converting an FP4Tensor to and from it.

Scales S [rows, cols] (cols = K/16 for NVFP4, K/32 for MXFP4) are zero-padded to rows % 128 == 0
and cols % 4 == 0, then cut into 128x4 tiles of 512 bytes, tiles in row-major order (all tiles
of the first 128 rows first). Inside a tile, row m and column k land at
(m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4: the four 32-row slabs are interleaved so that one
16-byte load gives a thread the 4 scales of 4 rows that are 32 apart. In full::

    offset(m, k) = ((m // 128) * (Kp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4

Check (docs/numerics.md "Scale-factor layout"): with Kp = 8, (m=5, k=2) -> 82 and (5, 5) -> 593. Padding bytes are zero.
As a reshape: [Rp, Kp] -> [Rp/128, 4, 32, Kp/4, 4] -> permute (0, 3, 2, 1, 4) -> flat.

Public: ``swizzled_offset``, ``swizzle_scales``, ``unswizzle_scales``, ``with_scale_layout``.
"""

from __future__ import annotations

import dataclasses

import torch

from .types import FP4Tensor, ScaleLayout


def _padded(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // 128) * 128, -(-cols // 4) * 4


def swizzled_offset(m: torch.Tensor | int, k: torch.Tensor | int, cols: int):
    """Byte offset of scale (m, k) in the swizzled buffer of a scale matrix with ``cols`` columns."""
    kp = _padded(1, cols)[1]
    return ((m // 128) * (kp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """scales: [rows, cols] one-byte dtype -> [Rp * Kp] same dtype, swizzled, zero padded."""
    if scales.dim() != 2:
        raise ValueError(f"swizzle_scales takes a 2D [rows, cols] scale matrix, got {tuple(scales.shape)}")
    if scales.element_size() != 1:
        raise TypeError(f"scales must be a one-byte dtype, got {scales.dtype}")
    dtype, rows, cols = scales.dtype, *scales.shape
    rp, kp = _padded(rows, cols)
    padded = torch.zeros(rp, kp, dtype=torch.uint8, device=scales.device)
    padded[:rows, :cols] = scales.view(torch.uint8)
    tiles = padded.reshape(rp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(dtype)


def unswizzle_scales(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """buffer: [Rp * Kp] swizzled bytes -> [rows, cols] scales (the padding is dropped)."""
    rp, kp = _padded(rows, cols)
    if buffer.dim() != 1 or buffer.numel() != rp * kp:
        raise ValueError(f"a swizzled buffer for [{rows}, {cols}] scales has {rp * kp} bytes "
                         f"(padded to [{rp}, {kp}]), got shape {tuple(buffer.shape)}")
    dtype = buffer.dtype
    tiles = buffer.view(torch.uint8).reshape(rp // 128, kp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rp, kp)[:rows, :cols].contiguous().view(dtype)


def with_scale_layout(q: FP4Tensor, layout: str | ScaleLayout) -> FP4Tensor:
    """q with its scales in ``layout``; the swizzled layout treats all lead dims as rows."""
    layout = ScaleLayout.parse(layout)
    if layout is q.scale_layout:
        return q
    rows = q.lead_shape.numel()
    cols = q.padded_len // q.block_len
    if layout is ScaleLayout.SWIZZLED:
        scales = swizzle_scales(q.scales.reshape(rows, cols))
    else:
        scales = unswizzle_scales(q.scales, rows, cols).reshape(*q.lead_shape, cols)
    return dataclasses.replace(q, scales=scales, scale_layout=layout)
