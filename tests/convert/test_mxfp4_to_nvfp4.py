"""MXFP4 -> NVFP4: lossless where the exponent spread allows, best never worse than requant."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fp4lab.convert import mxfp4_to_nvfp4
from fp4lab.convert.mxfp4_to_nvfp4 import (M_RANGE, _e4m3_pow2, _exponents, _hybrid, _live_blocks,
                                           _mse)
from fp4lab.formats import FP4Tensor, block_values, dequantize, quantize_mxfp4
from fp4lab.formats.codes import encode_e4m3
from fp4lab.studies.conversion import SCENARIOS, scenario_input


def mx_tensor(seed: int, spread: int, rows: int = 4, blocks: int = 4, zero_blocks: bool = True) -> FP4Tensor:
    """Random codes and block exponents k in [base, base + spread], some all-zero blocks."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, blocks * 16), generator=g, dtype=torch.uint8)
    base = int(torch.randint(-100, 100 - spread, (), generator=g))
    k = base + torch.randint(0, spread + 1, (rows, blocks), generator=g)
    k.view(-1)[0], k.view(-1)[-1] = base, base + spread
    if zero_blocks:
        codes.view(rows, blocks, 16)[0, 1] = 0
    return FP4Tensor(codes=codes, scales=(k + 127).to(torch.uint8), tensor_scale=None, shape=(rows, blocks * 32),
                     axis=1, block=(1, 32), format="mxfp4", rounding="rtne", mx_mode="rceil")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), spread=st.integers(0, 17))
def test_hybrid_is_exact_whenever_the_spread_is_at_most_17(seed, spread):
    q = mx_tensor(seed, spread)
    nv, report = mxfp4_to_nvfp4(q, "hybrid")
    assert report.lossless and report.blocks_out_of_range == 0
    assert torch.equal(dequantize(nv), dequantize(q))
    assert torch.equal(nv.codes, q.codes)  # the codes are kept verbatim


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), spread=st.integers(0, 60))
def test_best_is_never_worse_than_requant(seed, spread):
    q = mx_tensor(seed, spread)
    best = mxfp4_to_nvfp4(q, "best")[1]
    requant = mxfp4_to_nvfp4(q, "requant")[1]
    assert best.mse <= requant.mse
    if spread <= 17:
        assert best.lossless


def test_spread_18_is_where_verbatim_stops_being_exact():
    q = mx_tensor(1, 18, zero_blocks=False)
    hybrid = mxfp4_to_nvfp4(q, "hybrid")[1]
    assert not hybrid.lossless and hybrid.blocks_out_of_range >= 1 and hybrid.m == hybrid.spread - 8 + int(
        _exponents(q).min())
    mid = mxfp4_to_nvfp4(q, "verbatim-mid")[1]
    assert mid.blocks_out_of_range >= 1 and mid.chosen == "verbatim-mid"


def test_hybrid_near_the_top_exponent_keeps_its_tensor_scale_in_range():
    # k_max 125 with a spread of 18: the closed form m = k_max - 8 = 117 would make the requant
    # amax 2688 * 2^m overflow fp32; hybrid takes the largest m that works and requantizes the rest
    q = mx_tensor(3, 18, zero_blocks=False)
    k = q.scales.to(torch.int64) - 127
    q = FP4Tensor(codes=q.codes, scales=(k - int(k.max()) + 125 + 127).to(torch.uint8), tensor_scale=None,
                  shape=q.shape, axis=1, block=(1, 32), format="mxfp4", rounding="rtne", mx_mode="rceil")
    nv, report = mxfp4_to_nvfp4(q, "hybrid")
    assert report.m == M_RANGE[1] and report.blocks_out_of_range >= 1 and torch.isfinite(dequantize(nv)).all()
    assert report.rel_mse < 0.05


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "large_flat"])
def test_closed_form_m_is_the_search_optimum_and_best_beats_requant(name):
    q = quantize_mxfp4(scenario_input(name), mode="rceil", pad=True)
    k, live = _exponents(q), _live_blocks(q)
    k_max, k_min = int(k[live].max()), int(k[live].min())
    reference, count = block_values(q).double(), q.shape.numel()
    closed = _mse(_hybrid(q, k, live, k_max - 8)[0], reference, count)
    lo, hi = sorted((k_max - 8, k_min + 9))
    searched = min(_mse(_hybrid(q, k, live, m)[0], reference, count) for m in range(lo - 4, hi + 5)
                   if M_RANGE[0] <= m <= M_RANGE[1])
    assert closed == searched
    assert mxfp4_to_nvfp4(q, "best")[1].mse <= mxfp4_to_nvfp4(q, "requant")[1].mse


def test_bad_input():
    q = mx_tensor(0, 3)
    bad = FP4Tensor(**{**q.__dict__, "scales": q.scales.clone().index_fill_(1, torch.tensor([2]), 0xFF)})
    with pytest.raises(ValueError, match="NaN"):
        mxfp4_to_nvfp4(bad)
    from fp4lab.formats import quantize_nvfp4
    with pytest.raises(TypeError, match="MXFP4"):
        mxfp4_to_nvfp4(quantize_nvfp4(torch.randn(2, 32)))
    with pytest.raises(ValueError, match="'requant'"):
        mxfp4_to_nvfp4(q, "magic")


def test_byte_helpers_match_their_plain_definitions():
    """The uint8 fast paths: E4M3 powers of two for every UE8M0 byte and m, and the 8-byte live test
    (sign-only -0 codes are zero) against the byte-wise one."""
    scales = torch.arange(0, 255, dtype=torch.uint8)
    for m in range(-127 - 8, 127 - 8 + 1):  # every closed-form m = k_max - 8, which covers M_RANGE
        e = (scales.to(torch.int64) - 127 - m).clamp(-9, 8)
        expected = encode_e4m3(torch.ldexp(torch.ones(e.shape), e.to(torch.int32))).view(torch.uint8)
        assert torch.equal(_e4m3_pow2(scales, m), expected), m
    q = mx_tensor(0, 5, rows=8, blocks=6, zero_blocks=False)
    blocks = q.codes.view(8, 6, 16)
    blocks[1, 2], blocks[3, 4], blocks[5, 0] = 0x88, 0x08, 0  # -0 everywhere, one -0, all zero
    blocks[6, 1] = 0
    blocks[6, 1, 15] = 0x10  # a single nonzero code in the block's last byte
    expected = ((blocks & 0x77) != 0).any(-1)
    assert torch.equal(_live_blocks(q), expected) and expected.sum() == 8 * 6 - 3
    strided = FP4Tensor(**{**q.__dict__, "codes": q.codes.t().contiguous().t()})  # the byte-wise path
    assert torch.equal(_live_blocks(strided), expected)
