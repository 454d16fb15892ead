"""Dequantize an FP4Tensor: ``x ~= e2m1_value * block_scale * tensor_scale``.

The product ``e2m1_value * block_scale`` is exact in fp32 (and in bf16: a 2-bit by 4-bit
significand, within range), so the only rounding is the multiply by the FP32 tensor scale
(NVFP4), then the cast to ``dtype``. Padding is cropped and the block axis moved back, so the
result has the source tensor's shape. A NaN scale (a non-finite source block) gives NaN.

Public: ``dequantize``, ``block_values``, ``block_scales``, ``check_dequantize_args``.
"""

from __future__ import annotations

import torch

from .blocks import blocks_of, restore
from .codes import decode_e2m1, unpack_nibbles
from .layout import with_scale_layout
from .types import FP4Tensor, ScaleLayout


def block_scales(q: FP4Tensor) -> torch.Tensor:
    """q -> [*lead, Lp / block_len] float32 decoded block scales (E4M3 or UE8M0), plain layout."""
    q = with_scale_layout(q, ScaleLayout.PLAIN)
    return q.format.spec.decode_scale(q.scales)


def block_values(q: FP4Tensor) -> torch.Tensor:
    """q -> [*lead, Lp] float32 ``e2m1_value * block_scale`` (exact; no tensor scale)."""
    values = blocks_of(decode_e2m1(unpack_nibbles(q.codes)), q.block_len)
    return (values * block_scales(q)[..., None]).reshape(*q.lead_shape, q.padded_len)


def check_dequantize_args(q: FP4Tensor, dtype: torch.dtype) -> None:
    """TypeError unless q is an FP4Tensor and dtype a floating dtype (an integer dtype would
    truncate the values silently)."""
    if not isinstance(q, FP4Tensor):
        raise TypeError(f"dequantize takes an FP4Tensor, got {type(q).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dequantize writes a floating dtype (float32, bfloat16, float16, ...), got {dtype}")


def dequantize(q: FP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q -> [q.shape] ``dtype`` tensor."""
    check_dequantize_args(q, dtype)
    values = block_values(q)
    if q.tensor_scale is not None:
        values = values * q.tensor_scale
    return restore(values, q.shape, q.axis).to(dtype)
