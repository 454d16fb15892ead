"""diff_quantizers: the te vs torchao differences docs/numerics.md predicts, planted rounding changes,
and nothing at all for a quantizer against itself."""

import math

import pytest
import torch

from fp4lab.formats import quantize_mxfp4, quantize_nvfp4
from fp4lab.verify import RULES, diff_quantizers


def te(x):
    return quantize_nvfp4(x, profile="te")


def torchao(x):
    return quantize_nvfp4(x, profile="torchao")


def gaussian(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("quantizer", [te, torchao, lambda x: quantize_mxfp4(x, mode="rceil")])
def test_a_quantizer_against_itself_has_no_differences(quantizer):
    x = gaussian((64, 128), 0, torch.bfloat16)
    x[0, :32] = 0
    diff = diff_quantizers(quantizer, quantizer, x)
    assert diff.ok and (diff.code_bytes, diff.elements, diff.scale_bytes, diff.blocks) == (0, 0, 0, 0)
    assert diff.tensor_scale is None and diff.rules == {} and diff.examples == []
    assert "identical" in str(diff)


def test_all_zero_and_tiny_blocks_te_flushes_torchao_floors():
    x = gaussian((4, 64), 1)
    x[0, :16] = 0  # all zero
    x[1, 16:32] *= 1e-9  # underflows te's E4M3 scale
    diff = diff_quantizers(te, torchao, x, names=("te", "torchao"))
    assert diff.rules.get("scale_floor") == 2 and diff.scale_bytes >= 2
    zero = next(ex for ex in diff.examples if ex["block"] == (0, 0))
    assert (zero["scale_a"], zero["scale_b"], zero["rule"]) == ("0x00", "0x08", "scale_floor")
    # an all-zero block's 0x00 is also what four_over_six (te's arithmetic) gives it
    assert zero["matches_a"] == ["te", "four_over_six"] and zero["matches_b"] == ["torchao"]
    assert "torchao floors the scale at 2^-6" in zero["note"]
    assert next(ex for ex in diff.examples if ex["block"] == (1, 1))["rule"] == "scale_floor"


def test_e4m3_tie_in_the_block_scale():
    # docs/numerics.md "NVFP4" / tests/formats: amax 260, block amax 0.01190185546875 -> exact scale 0.0205078125,
    # the midpoint of E4M3 0x0a and 0x0b; te's folded fp32(1/6) rounds it up
    x = torch.tensor([[260.0] + [0.0] * 15, [0.01190185546875] + [0.0] * 15])
    diff = diff_quantizers(te, torchao, x, names=("te", "torchao"))
    assert diff.rules == {"scale_tie": 1}
    ex = diff.examples[0]
    assert (ex["block"], ex["scale_a"], ex["scale_b"]) == ((1, 0), "0x0b", "0x0a")
    assert "0.0205078125 is the midpoint" in ex["note"] and "te rounds up" in ex["note"]


def test_gaussian_bf16_differences_are_all_e4m3_ties():
    diff = diff_quantizers(te, torchao, gaussian((128, 256), 4, torch.bfloat16), names=("te", "torchao"))
    assert diff.scale_bytes > 0 and diff.rules.get("scale_tie") == diff.scale_bytes
    assert set(diff.rules) <= {"scale_tie", "element_tie"}
    assert all(ex["matches_a"] == ["te"] and ex["matches_b"] == ["torchao"] for ex in diff.examples)


def test_element_rounding_tie_with_equal_scales():
    # amax 5.25 -> S_enc = 512 exactly; block amax 3 -> scale 256, e_b = 2: 1.25 -> 2.5 and
    # 0.125 -> 0.25 are E2M1 ties, which RTNE sends down and a planted "half up" kernel up
    x = torch.zeros(2, 16)
    x[0, 0] = 5.25
    x[1, :6] = torch.tensor([3.0, 1.25, 1.75, 0.125, 0.375, -1.25])

    def half_up(t):  # nudges every non-maximal element off its tie, upward in magnitude
        return te(t * (1 + 2.0**-12 * (t.abs() < t.abs().max())))
    diff = diff_quantizers(te, half_up, x, names=("te", "half_up"))
    assert diff.scale_bytes == 0 and diff.tensor_scale is None
    # 2.5, 0.25, -2.5 differ; 3.5 and 0.75 do not: their even neighbour (4, 1) is also the one above
    assert diff.rules == {"element_tie": 1} and diff.elements == 3
    ex = diff.examples[0]
    assert ex["codes_a"][1] == 4 and ex["codes_b"][1] == 5  # 2.5 -> 2 (RTNE) vs 3


def test_stochastic_vs_rtne_is_element_rounding():
    x = gaussian((32, 64), 3)
    diff = diff_quantizers(te, lambda t: quantize_nvfp4(t, rounding="stochastic", seed=5), x)
    assert diff.scale_bytes == 0 and diff.elements > 0
    assert diff.rules.get("element_rounding", 0) > 0.9 * diff.blocks


def test_nan_policy_difference():
    x = gaussian((4, 32), 4)
    x[2, 3] = math.nan
    diff = diff_quantizers(te, lambda t: te(t.nan_to_num(nan=0.0)), x)
    assert diff.rules == {"nonfinite": 1} and diff.examples[0]["block"] == (2, 0)
    assert diff.examples[0]["scale_a"] == "0x7f"


def test_tensor_scale_difference():
    x = gaussian((16, 64), 5)
    amax = float(x.abs().max())
    diff = diff_quantizers(te, lambda t: quantize_nvfp4(t, global_amax=2 * amax), x)
    assert diff.tensor_scale is not None and diff.tensor_scale[1] == pytest.approx(2 * diff.tensor_scale[0])
    assert "tensor_scale" in diff.rules and "tensor scale" in str(diff)


def test_mx_exponent_modes_are_named():
    x = gaussian((8, 64), 6)
    diff = diff_quantizers(lambda t: quantize_mxfp4(t, mode="floor"), lambda t: quantize_mxfp4(t, mode="rceil"), x)
    assert set(diff.rules) == {"mx_exponent"} and diff.blocks > 0
    for ex in diff.examples:
        assert "floor" in ex["matches_a"] and "rceil" in ex["matches_b"] and "rceil" not in ex["matches_a"]


def test_rules_have_descriptions_and_errors_are_clear():
    assert {"scale_floor", "scale_tie", "element_tie", "nonfinite", "tensor_scale"} <= set(RULES)
    x = gaussian((4, 64), 7)
    with pytest.raises(ValueError, match="cannot compare"):
        diff_quantizers(te, lambda t: quantize_mxfp4(t), x)
    with pytest.raises(TypeError, match="must return an FP4Tensor"):
        diff_quantizers(te, lambda t: t, x)
