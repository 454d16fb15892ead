"""check_gemm: fp4lab's own GEMMs pass every rung; planted bugs fail at the rung made for them,
with a diagnosis that names the bug."""

import pytest
import torch

from fp4lab.formats import pack_nibbles, unpack_nibbles
from fp4lab.formats.layout import _padded
from fp4lab.verify import check_gemm, emulated_gemm, kernels_gemm, reference_gemm

SHAPES = ((1, 1, 32), (7, 5, 64), (33, 17, 96))  # small random shapes: the exact ladder is the point here
EXACT = (136, 24, 96)  # past one 128-row tile; 6 (NVFP4) / 3 (MXFP4) scale columns: padding both ways
FMTS = ["nvfp4", "mxfp4"]
LAYOUTS = ["plain", "swizzled"]


def _block(scales):
    return 16 if scales.dtype == torch.float8_e4m3fn else 32


def _swap_nibbles(codes):
    return (codes << 4) | (codes >> 4)


# planted bugs: each wraps the reference and breaks one thing
def swapped_nibbles_in_a(a, sa, b, sb, alpha, m, n, k):
    return reference_gemm(_swap_nibbles(a), sa, b, sb, alpha, m, n, k)


def swapped_nibbles_in_b(a, sa, b, sb, alpha, m, n, k):
    return reference_gemm(a, sa, _swap_nibbles(b), sb, alpha, m, n, k)


def missing_alpha(a, sa, b, sb, alpha, m, n, k):
    return reference_gemm(a, sa, b, sb, torch.ones_like(alpha), m, n, k)


def codes_one_block_late(a, sa, b, sb, alpha, m, n, k):
    """A's code block j is read from block j - 1 (wrapping)."""
    return reference_gemm(torch.roll(a, _block(sa) // 2, dims=1), sa, b, sb, alpha, m, n, k)


def scales_read_column_major(a, sa, b, sb, alpha, m, n, k):
    t = lambda s: s.reshape(-1).reshape(s.shape[1], s.shape[0]).T.contiguous()  # noqa: E731
    return reference_gemm(a, t(sa), b, t(sb), alpha, m, n, k)


def b_scale_block_off_by_one(a, sa, b, sb, alpha, m, n, k):
    """B's block j uses the scale of block j - 1 (wrapping)."""
    return reference_gemm(a, sa, b, torch.roll(sb.view(torch.uint8), 1, dims=1).view(sb.dtype), alpha, m, n, k)


def swizzle_slabs_swapped(a, sa, b, sb, alpha, m, n, k):
    """A's swizzled scales decoded with the 32-row slab and the row inside it exchanged."""
    rows, cols = m, k // _block(sa)
    rp, kp = _padded(rows, cols)
    tiles = sa.view(torch.uint8).reshape(rp // 128, kp // 4, 4, 32, 4).permute(0, 3, 1, 2, 4)
    plain = tiles.reshape(rp, kp)[:rows, :cols].contiguous().view(sa.dtype)
    return reference_gemm(a, plain, b, sb, alpha, m, n, k)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("fn", [reference_gemm, emulated_gemm, kernels_gemm("reference")],
                         ids=["scaled_mm", "emulated_mm", "kernels_reference"])
def test_fp4lab_gemms_pass(fn, fmt, layout):
    result = check_gemm(fn, fmt=fmt, layout=layout, exact_shape=EXACT, shapes=SHAPES)
    assert result.ok and result.rung is None, str(result)
    assert [s["shape"] for s in result.details["random"]] == ["136x24x96", "1x1x32", "7x5x64", "33x17x96"]
    assert all(s["worst_over_bound"] <= 1 for s in result.details["random"])
    if fn is reference_gemm:  # the reference against itself: bit for bit everywhere
        assert all(s["max_abs"] == 0 for s in result.details["random"])
    assert "PASS" in str(result)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_kernel_passes_in_the_interpreter(fmt, layout):
    pytest.importorskip("triton")
    for method in ("fused", "two_stage") if (fmt, layout) == ("nvfp4", "plain") else ("fused",):
        result = check_gemm(kernels_gemm("triton", method=method), fmt=fmt, layout=layout,
                            exact_shape=(40, 24, 64), shapes=((33, 17, 96),),
                            device="cuda" if torch.cuda.is_available() else "cpu")
        assert result.ok, str(result)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("bug", [swapped_nibbles_in_a, swapped_nibbles_in_b])
def test_swapped_nibbles_fail_at_identity(bug, fmt, layout):
    result = check_gemm(bug, fmt=fmt, layout=layout, exact_shape=EXACT, shapes=SHAPES)
    assert not result.ok and result.rung == "identity"
    assert "nibble order is swapped" in result.message
    assert result.details["element"] == 0 and result.details["row"] == 0


def test_a_nibble_swap_in_both_operands_is_invisible_to_a_gemm():
    """The same permutation of both operands' elements leaves every dot product unchanged."""
    def both(a, sa, b, sb, alpha, m, n, k):
        return reference_gemm(_swap_nibbles(a), sa, _swap_nibbles(b), sb, alpha, m, n, k)
    assert check_gemm(both, exact_shape=EXACT, shapes=SHAPES).ok


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_missing_alpha_fails_at_alpha(fmt, layout):
    result = check_gemm(missing_alpha, fmt=fmt, layout=layout, shapes=SHAPES)
    assert not result.ok and result.rung == "alpha"
    assert "alpha was not applied" in result.message
    assert result.details["got"] == result.details["without_alpha"] == 2.25 * 160


@pytest.mark.parametrize("fmt", FMTS)
def test_code_block_off_by_one_is_named(fmt):
    result = check_gemm(codes_one_block_late, fmt=fmt, exact_shape=EXACT, shapes=SHAPES)
    bl = 16 if fmt == "nvfp4" else 32
    assert not result.ok and result.rung == "identity"
    assert result.details["element_shift"] == bl and "+1 block(s)" in result.message


def test_a_bug_only_on_dense_blocks_fails_at_one_hot():
    """Rows with several nonzero codes get their blocks shifted by one: invisible to uniform data and to
    the single 1.0 of the identity rung, caught by one_hot with the shift named."""
    def dense_rows_shifted(a, sa, b, sb, alpha, m, n, k):
        codes = unpack_nibbles(a)
        dense = ((codes & 7) != 0).sum(1) > 1
        codes[dense] = torch.roll(codes[dense], 16, dims=1)
        return reference_gemm(pack_nibbles(codes), sa, b, sb, alpha, m, n, k)
    result = check_gemm(dense_rows_shifted, exact_shape=EXACT, shapes=SHAPES)
    assert result.rung == "one_hot" and result.details["block_shift"] == 1
    assert "code block index off by +1" in result.message


@pytest.mark.parametrize("fmt", FMTS)
def test_column_major_scales_fail_at_scale_positions(fmt):
    result = check_gemm(scales_read_column_major, fmt=fmt, shapes=SHAPES)
    assert not result.ok and result.rung == "scale_positions"
    assert "read column-major" in result.message
    d = result.details
    nb = 10 if fmt == "nvfp4" else 5
    assert d["operand"] == "A" and d["read_row"] * nb + d["read_block"] == d["block"] * 136 + d["row"]


@pytest.mark.parametrize("fmt", FMTS)
def test_scale_block_off_by_one_fails_at_scale_positions(fmt):
    result = check_gemm(b_scale_block_off_by_one, fmt=fmt, exact_shape=EXACT, shapes=SHAPES)
    assert not result.ok and result.rung == "scale_positions"
    assert result.details["operand"] == "B" and "block index off by -1" in result.message


@pytest.mark.parametrize("fmt", FMTS)
def test_swizzle_remap_is_located_by_offset(fmt):
    # no padding in this shape, so the wrong remap only moves real scales: scale_positions finds it
    result = check_gemm(swizzle_slabs_swapped, fmt=fmt, layout="swizzled", exact_shape=(128, 24, 128), shapes=SHAPES)
    assert not result.ok and result.rung == "scale_positions"
    d = result.details
    assert d["operand"] == "A" and "swizzled offset" in result.message
    assert d["expected_offset"]["row"] == d["row"] and d["read_offset"]["row"] == d["read_row"]
    # with padding in play the same bug already breaks the all-ones case
    result = check_gemm(swizzle_slabs_swapped, fmt=fmt, layout="swizzled", shapes=SHAPES)
    assert result.rung == "uniform" and "whole block(s) missing" in result.message


def test_contract_violations_are_reported_at_their_rung():
    def crash(*args):
        raise RuntimeError("kernel exploded")
    result = check_gemm(crash, shapes=SHAPES)
    assert result.rung == "uniform" and "RuntimeError: kernel exploded" in result.message
    result = check_gemm(lambda *args: reference_gemm(*args).bfloat16(), shapes=SHAPES)
    assert result.rung == "uniform" and "float32" in result.message
    result = check_gemm(lambda *args: reference_gemm(*args)[:-1], shapes=SHAPES)
    assert "[136, 40]" in result.message
    result = check_gemm(lambda *args: reference_gemm(*args) * float("nan"), shapes=SHAPES)
    assert result.rung == "uniform" and "= nan" in result.message


def test_random_rung_catches_an_inexact_gemm():
    """Exact on small integers, but a bf16 rounding of C breaks the summation bound on random data."""
    def bf16_output(*args):
        return reference_gemm(*args).bfloat16().float()
    result = check_gemm(bf16_output, exact_shape=EXACT, shapes=SHAPES)
    assert result.rung == "random" and "exceeds the FP32 summation bound" in result.message
    assert result.details["error"] > result.details["bound"]


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="divisible by the mxfp4 block size 32"):
        check_gemm(reference_gemm, fmt="mxfp4", shapes=((4, 4, 48),))
    with pytest.raises(ValueError, match="unknown ScaleLayout"):
        check_gemm(reference_gemm, layout="column")
