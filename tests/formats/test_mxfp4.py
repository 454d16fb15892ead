"""MXFP4 quantization: the four scale modes against the oracle and torchao, round trips, errors."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fp4lab.formats import FP4Tensor, dequantize, pack_nibbles, quantize_mxfp4, unpack_nibbles
from fp4lab.formats.mxfp4 import mx_exponent
from fp4lab.formats.types import MXScaleMode
from tests.formats import oracle
from tests.formats.test_nvfp4 import sample

MODES = ["floor", "ceil", "even", "rceil"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(3))
def test_matches_the_scalar_oracle(mode, seed):
    x = sample((6, 96), seed, spread=20.0)  # reaches the clamp at both ends
    x[0, :32] = 0
    x[1, 32:64] = 1e-42  # subnormal amax
    q = quantize_mxfp4(x, mode=mode)
    codes, scales = oracle.mxfp4(x.numpy(), mode)
    assert q.scales.flatten().tolist() == scales
    assert unpack_nibbles(q.codes).flatten().tolist() == codes


# (amax, floor, ceil, even, rceil): docs/numerics.md "MXFP4"
EXPONENT_CASES = [(7.9, 0, 1, 1, 1), (6.0, 0, 1, 0, 0), (4.0, 0, 0, 0, 0), (6.1, 0, 1, 0, 1),
                  (7.0, 0, 1, 1, 1), (1.0, -2, -2, -2, -2), (0.75, -3, -2, -3, -3), (2.0**-130, -127, -127, -127, -127),
                  (3.0e38, 125, 126, 126, 126), (0.0, -127, -127, -127, -127)]


@pytest.mark.parametrize("amax,floor,ceil,even,rceil", EXPONENT_CASES, ids=[str(c[0]) for c in EXPONENT_CASES])
def test_scale_exponent_table(amax, floor, ceil, even, rceil):
    for mode, want in zip(MODES, (floor, ceil, even, rceil)):
        assert mx_exponent(torch.tensor([amax]), MXScaleMode(mode)).item() == want, mode


def test_floor_clips_where_numerics_says():
    x = torch.zeros(1, 32)
    x[0, 0] = 7.9
    assert dequantize(quantize_mxfp4(x, mode="floor"))[0, 0].item() == 6.0  # saturated
    assert dequantize(quantize_mxfp4(x, mode="rceil"))[0, 0].item() == 8.0


@pytest.mark.parametrize("mode", MODES)
def test_matches_torchao_0_18_when_installed(mode):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    x = sample((64, 256), 1)
    scale, data = mx_tensor.to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode[mode.upper()])
    q = quantize_mxfp4(x, mode=mode)
    assert torch.equal(scale.view(torch.uint8).reshape(q.scales.shape), q.scales)
    assert torch.equal(data.view(torch.uint8).reshape(q.codes.shape), q.codes)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_requantizing_a_dequantized_tensor_is_exact(mode, seed):
    # a block whose largest magnitude code is 4 (code 6) decodes to amax 4 * 2^e, which every
    # mode maps back to e
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (4, 64), generator=g, dtype=torch.uint8)
    codes = torch.where(codes & 7 == 7, codes - 1, codes)  # no 6.0
    codes[:, ::32] = 6 | (codes[:, ::32] & 8)
    # exponents up to 125: 4 * 2^125 is the largest amax a finite fp32 tensor decodes to here
    scales = torch.randint(0, 253, (4, 2), generator=g, dtype=torch.uint8)
    q = FP4Tensor(codes=pack_nibbles(codes), scales=scales, tensor_scale=None, shape=(4, 64), axis=1,
                  block=(1, 32), format="mxfp4", rounding="rtne", mx_mode=mode)
    again = quantize_mxfp4(dequantize(q), mode=mode)
    assert torch.equal(again.scales, q.scales) and torch.equal(again.codes, q.codes)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), blocks=st.integers(1, 3), seed=st.integers(0, 2**16),
       mode=st.sampled_from(["ceil", "rceil"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_non_clipping_modes_are_within_half_a_step(rows, blocks, seed, mode, dtype):
    x = sample((rows, 32 * blocks), seed).to(dtype).float()
    q = quantize_mxfp4(x.to(dtype), mode=mode)
    s = torch.ldexp(torch.ones(q.scales.shape), q.scales.long() - 127)[..., None]
    v = x.reshape(rows, blocks, 32).abs() / s
    assert bool((v <= 6).all())
    half_step = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0)) * s
    err = (dequantize(q) - x).abs().reshape(rows, blocks, 32)
    assert bool((err <= half_step).all())


def test_stochastic_rounding_is_seeded_and_unbiased():
    x = torch.full((2048, 32), 0.3)
    x[:, 0] = 4.0  # exponent 0: elements are quantized as they are
    a = quantize_mxfp4(x, rounding="stochastic", seed=9)
    assert torch.equal(a.codes, quantize_mxfp4(x, rounding="stochastic", seed=9).codes)
    assert bool((a.scales == 127).all())
    values = dequantize(a)[:, 1:]
    p = math.ceil(256 * 0.6) / 256  # 0.3 sits 0.6 of the way from 0 to 0.5
    sd = math.sqrt(p * (1 - p) / values.numel()) * 0.5
    assert abs(values.mean().item() - 0.5 * p) < 5 * sd


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_block_gets_the_nan_scale(bad):
    x = sample((2, 64), 3)
    x[1, 40] = bad
    q = quantize_mxfp4(x)
    assert q.scales.tolist()[1][1] == 0xFF and q.scales[0].tolist() != [0xFF, 0xFF]
    assert bool(dequantize(q)[1, 32:].isnan().all()) and bool(dequantize(q)[1, :32].isfinite().all())


def test_errors_and_padding():
    with pytest.raises(ValueError, match="'floor', 'ceil', 'even', 'rceil'"):
        quantize_mxfp4(torch.zeros(2, 32), mode="round")
    with pytest.raises(ValueError, match="block size 32"):
        quantize_mxfp4(torch.zeros(2, 48))
    q = quantize_mxfp4(sample((3, 48), 0), pad=True)
    assert q.codes.shape == (3, 32) and dequantize(q).shape == (3, 48)
    assert dequantize(quantize_mxfp4(torch.zeros(0, 32))).shape == (0, 32)
