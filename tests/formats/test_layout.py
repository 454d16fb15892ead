"""The swizzled 128x4 scale layout: the index formula, every byte's destination, round trips."""

import pytest
import torch

from fp4lab.formats import (dequantize, quantize_mxfp4, quantize_nvfp4, swizzle_scales, swizzled_offset,
                            unswizzle_scales, with_scale_layout)
from fp4lab.formats.types import ScaleLayout


def test_numerics_index_checks():
    assert swizzled_offset(5, 2, cols=8) == 82
    assert swizzled_offset(5, 5, cols=8) == 593


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 3), (128, 4), (130, 9), (257, 8), (300, 17)])
def test_every_byte_lands_where_the_formula_says(rows, cols):
    # distinct values (mod 255, +1 so nothing is zero) make every destination checkable
    src = (torch.arange(rows * cols) % 255 + 1).to(torch.uint8).reshape(rows, cols)
    buf = swizzle_scales(src)
    rp, kp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert buf.shape == (rp * kp,)
    m, k = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    offsets = swizzled_offset(m, k, cols)
    assert torch.equal(buf[offsets.flatten()], src.flatten())
    padding = torch.ones(rp * kp, dtype=torch.bool)
    padding[offsets.flatten()] = False
    assert bool((buf[padding] == 0).all())  # padding is zeros
    assert torch.equal(unswizzle_scales(buf, rows, cols), src)


def test_e4m3_scales_keep_their_dtype():
    s = torch.rand(7, 3).to(torch.float8_e4m3fn)
    buf = swizzle_scales(s)
    assert buf.dtype == torch.float8_e4m3fn
    assert torch.equal(unswizzle_scales(buf, 7, 3).view(torch.uint8), s.view(torch.uint8))


@pytest.mark.parametrize("quantize", [quantize_nvfp4, quantize_mxfp4], ids=["nvfp4", "mxfp4"])
def test_fp4_tensor_round_trip_through_the_swizzled_layout(quantize):
    x = torch.randn(3, 70, 64)
    q = quantize(x)
    sw = with_scale_layout(q, "swizzled")
    assert sw.scale_layout is ScaleLayout.SWIZZLED and sw.scales.dim() == 1
    assert torch.equal(dequantize(sw), dequantize(q))
    back = with_scale_layout(sw, ScaleLayout.PLAIN)
    assert torch.equal(back.scales.view(torch.uint8), q.scales.view(torch.uint8))


def test_bad_shapes():
    with pytest.raises(ValueError, match="2D"):
        swizzle_scales(torch.zeros(2, 2, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="one-byte"):
        swizzle_scales(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="512 bytes"):
        unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 5, 3)
