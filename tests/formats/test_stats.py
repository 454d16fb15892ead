"""Quantization statistics: exact, flushed and saturating cases."""

import math

import torch

from fp4lab.formats import quant_stats, quantize_mxfp4, quantize_nvfp4


def test_exactly_representable_tensor_has_infinite_sqnr():
    x = torch.tensor([[6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2]) * 2.0**-3
    s = quant_stats(x, quantize_nvfp4(x, global_amax=2688.0))  # S_enc = 1: scales exact
    assert s["sqnr_db"] == math.inf and s["rel_error"] == 0 and s["saturated"] == 0


def test_te_flushes_tiny_blocks_that_torchao_keeps():
    # amax 2688 makes S_enc = 1; a block of 0.005 needs scale 0.005 / 6 < 2^-10: te's E4M3 scale
    # rounds to 0, torchao floors it at 2^-6 and keeps 0.005 * 64 = 0.32 -> code 0.5
    x = torch.randn(4, 64)
    x[1, 0] = 2688.0
    x[0, :16] = 0.005
    te, ao = (quant_stats(x, quantize_nvfp4(x, profile=p)) for p in ("te", "torchao"))
    assert te["flushed_blocks"] == 1 / 16 and ao["flushed_blocks"] == 0


def test_floor_mode_saturates_and_rceil_does_not():
    x = torch.zeros(2, 32)
    x[:, 0] = 7.9
    floor, rceil = (quant_stats(x, quantize_mxfp4(x, mode=m)) for m in ("floor", "rceil"))
    assert floor["saturated"] == 1 / 32 and rceil["saturated"] == 0
    assert floor["scale_log2_max"] == 0 and rceil["scale_log2_max"] == 1


def test_fractions_count_real_elements_not_padding():
    x = torch.full((2, 10), 100.0)
    s = quant_stats(x, quantize_nvfp4(x, global_amax=1.0, pad=True))  # everything saturates
    assert s["saturated"] == 1.0
    t = quant_stats(x, quantize_nvfp4(x, block=(16, 16), global_amax=1.0, pad=True))
    assert t["saturated"] == 1.0 and t["flushed_blocks"] == 0


def test_sqnr_of_gaussian_nvfp4_is_about_20_db():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    s = quant_stats(x, quantize_nvfp4(x))
    assert 19 < s["sqnr_db"] < 22 and abs(s["rel_error"] - 10 ** (-s["sqnr_db"] / 20)) < 1e-9
