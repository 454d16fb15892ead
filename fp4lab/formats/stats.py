"""How much a quantization lost: SQNR, relative error, flushed blocks, saturation, scale range.

Definitions (x the source, x_hat = dequantize(q), over finite source elements)::

    sqnr_db         10 log10(sum x^2 / sum (x - x_hat)^2)        inf when exact
    rel_error       ||x - x_hat|| / ||x||
    flushed_blocks  fraction of blocks with a nonzero source that dequantize to all zeros
    saturated       fraction of elements with |x| above their block's largest value, 6 * scale
    scale_log2_min / scale_log2_max   log2 of the smallest / largest nonzero effective block
                    scale (block scale times tensor scale) -- the dynamic range in use

Public: ``quant_stats``.
"""

from __future__ import annotations

import math

import torch

from .blocks import blocks_of, prepare
from .dequantize import block_scales, block_values
from .types import FP4Tensor


def quant_stats(x: torch.Tensor, q: FP4Tensor) -> dict[str, float]:
    """x: the tensor q was quantized from -> the statistics above, as plain floats."""
    xm, _ = prepare(x, q.axis, q.block, pad=True)  # stored layout: [*lead, Lp]
    if xm.shape != (*q.lead_shape, q.padded_len):
        raise ValueError(f"x of shape {tuple(x.shape)} is not the source of q ({tuple(q.shape)})")
    x_hat = block_values(q)
    if q.tensor_scale is not None:
        x_hat = x_hat * q.tensor_scale
    finite = torch.isfinite(xm)
    xf, err = torch.where(finite, xm, 0.0), torch.where(finite, xm - x_hat, 0.0)
    signal, noise = float(xf.double().square().sum()), float(err.double().square().sum())

    scale = block_scales(q).double()
    if q.tensor_scale is not None:
        scale = scale * float(q.tensor_scale)
    xb, hb = blocks_of(xf, q.block_len), blocks_of(x_hat, q.block_len)
    real = blocks_of(prepare(torch.ones_like(x), q.axis, q.block, pad=True)[0] != 0, q.block_len)
    nonzero_src = (xb != 0).any(-1)
    flushed = nonzero_src & (hb == 0).all(-1)
    saturated = xb.abs().double() > 6 * scale[..., None]
    used = scale[nonzero_src & (scale > 0)]
    # fractions of the real elements and blocks: padding is neither
    n_blocks, n_elems = max(int(real.any(-1).sum()), 1), max(int(real.sum()), 1)
    return {
        "sqnr_db": _db(signal, noise),
        "rel_error": math.sqrt(noise / signal) if signal > 0 else 0.0,
        "flushed_blocks": float(flushed.sum()) / n_blocks,
        "saturated": float(saturated.sum()) / n_elems,
        "scale_log2_min": math.log2(float(used.min())) if used.numel() else float("nan"),
        "scale_log2_max": math.log2(float(used.max())) if used.numel() else float("nan"),
    }


def _db(signal: float, noise: float) -> float:
    if noise == 0:
        return float("inf")
    return 10 * math.log10(signal / noise) if signal > 0 else float("-inf")
