"""The reference scaled GEMM and its BF16 emulation."""

import pytest
import torch

from fp4lab.formats import (FP4Tensor, block_values, dequantize, emulated_mm, gemm_alpha, pack_nibbles,
                            quantize_mxfp4, quantize_nvfp4, scaled_mm)
from tests.formats.test_nvfp4 import sample


def uniform_operand(rows, k, fmt):
    """Every code 1.5 (code 3), every block scale 1.0, tensor scale 1."""
    codes = pack_nibbles(torch.full((rows, k), 3, dtype=torch.uint8))
    if fmt == "nvfp4":
        scales = torch.ones(rows, k // 16).to(torch.float8_e4m3fn)
        return FP4Tensor(codes=codes, scales=scales, tensor_scale=torch.tensor(1.0), shape=(rows, k),
                         axis=1, block=(1, 16), format="nvfp4", rounding="rtne", profile="te")
    scales = torch.full((rows, k // 32), 127, dtype=torch.uint8)
    return FP4Tensor(codes=codes, scales=scales, tensor_scale=None, shape=(rows, k), axis=1,
                     block=(1, 32), format="mxfp4", rounding="rtne", mx_mode="floor")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mm", [scaled_mm, emulated_mm], ids=["scaled", "emulated"])
def test_all_codes_one_point_five_give_72_for_k_32(fmt, mm):
    out = mm(uniform_operand(8, 32, fmt), uniform_operand(4, 32, fmt))
    assert out.shape == (8, 4) and bool((out == 72.0).all())  # 1.5^2 * 32


def _summation_bound(qa, qb):
    """|scaled - emulated| <= 2 * K * 2^-24 * (|A| @ |B|^T) * alpha (two fp32 summation orders)."""
    a, b = dequantize(qa).double().abs(), dequantize(qb).double().abs()
    return 2 * qa.shape[1] * 2**-24 * (a @ b.T)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("weights", ["1x16", "16x16", "mxfp4"])
def test_scaled_and_emulated_agree_to_summation_order(seed, weights):
    x, w = sample((48, 256), seed), sample((48, 256), seed + 10)
    if weights == "mxfp4":
        qa, qb = quantize_mxfp4(x), quantize_mxfp4(w)
    else:
        qa, qb = quantize_nvfp4(x), quantize_nvfp4(w, block=16 if weights == "1x16" else (16, 16))
    ref, emu = scaled_mm(qa, qb), emulated_mm(qa, qb)
    exact = dequantize(qa).double() @ dequantize(qb).double().T
    bound = _summation_bound(qa, qb) + 1e-30
    assert bool(((ref.double() - emu.double()).abs() <= bound).all())
    assert bool(((ref.double() - exact).abs() <= bound).all())


def test_scaled_mm_is_deterministic_block_order_accumulation():
    qa, qb = quantize_nvfp4(sample((16, 64), 1)), quantize_nvfp4(sample((8, 64), 2))
    values = block_values  # code * block scale, exact
    acc = torch.zeros(16, 8)
    for j in range(4):
        acc += values(qa)[:, 16 * j:16 * j + 16] @ values(qb)[:, 16 * j:16 * j + 16].T
    assert torch.equal(scaled_mm(qa, qb), acc * (qa.tensor_scale * qb.tensor_scale))


def test_alpha_is_the_product_of_amaxes_over_2688_squared():
    x, w = sample((4, 32), 3), sample((4, 32), 4)
    qa, qb = quantize_nvfp4(x), quantize_nvfp4(w)
    expected = float(x.abs().max()) * float(w.abs().max()) / (6 * 6 * 448 * 448)
    assert abs(gemm_alpha(qa, qb).item() - expected) <= 4e-7 * expected


def test_padded_2d_weight_rows_are_cropped():
    qa = quantize_nvfp4(sample((5, 32), 0))
    qb = quantize_nvfp4(sample((20, 32), 1), block=(16, 16), pad=True)
    assert scaled_mm(qa, qb).shape == (5, 20) and emulated_mm(qa, qb).shape == (5, 20)


def test_mismatched_operands():
    a = quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(ValueError, match="K mismatch"):
        scaled_mm(a, quantize_nvfp4(torch.randn(4, 64)))
    with pytest.raises(ValueError, match="format"):
        scaled_mm(a, quantize_mxfp4(torch.randn(4, 32)))
    with pytest.raises(ValueError, match="2D"):
        scaled_mm(a, quantize_nvfp4(torch.randn(2, 4, 32)))
    with pytest.raises(TypeError, match="FP4Tensor"):
        scaled_mm(a, torch.randn(4, 32))


def test_a_columnwise_operand_is_its_transpose():
    x, w = sample((16, 64), 1), sample((32, 64), 2)
    qa = quantize_nvfp4(x)
    cols = quantize_nvfp4(w.T.contiguous(), axis=0)  # W^T [64, 32] along axis 0: stored [32, 32]
    assert torch.equal(scaled_mm(qa, cols), scaled_mm(qa, quantize_nvfp4(w)))
