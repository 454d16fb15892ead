"""The Triton emulated FP4 GEMM against the reference scaled GEMM."""

import math

import pytest
import torch

pytest.importorskip("triton")

from fp4lab import formats  # noqa: E402
from fp4lab.kernels.gemm import fp4_mm  # noqa: E402
from tests.formats.test_gemm import _summation_bound, uniform_operand  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


METHODS = ["fused", "two_stage", "decoded"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_uniform_codes_give_exactly_72(fmt, method):
    out = fp4_mm(uniform_operand(40, 32, fmt).to(DEVICE), uniform_operand(24, 32, fmt).to(DEVICE), method=method)
    assert bool((out == 72.0).all())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m,n,k,weights", [(64, 48, 128, "1x16"), (50, 70, 96, "16x16"), (130, 20, 64, "mxfp4"),
                                           (33, 200, 160, "1x16")])
def test_matches_scaled_mm_to_summation_order(m, n, k, weights, method):
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g))
    w = torch.randn(n, k, generator=g)
    if weights == "mxfp4":
        qa, qb = formats.quantize_mxfp4(x, pad=True), formats.quantize_mxfp4(w, pad=True)
    else:
        qa = formats.quantize_nvfp4(x)
        qb = formats.quantize_nvfp4(w, block=16 if weights == "1x16" else (16, 16), pad=True)
    ref = formats.scaled_mm(qa, qb)
    fast = fp4_mm(qa.to(DEVICE), qb.to(DEVICE), method=method).cpu()
    assert fast.shape == (m, n)
    assert bool(((fast.double() - ref.double()).abs() <= _summation_bound(qa, qb) + 1e-30).all())
    bf16 = fp4_mm(qa.to(DEVICE), qb.to(DEVICE), out_dtype=torch.bfloat16, method=method).cpu()
    assert bf16.dtype == torch.bfloat16 and torch.allclose(bf16.float(), fast, rtol=2**-7, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_nan_scale_poisons_its_outputs(method):
    x = torch.randn(16, 64)
    x[3, 20] = math.nan
    qa, qb = formats.quantize_nvfp4(x), formats.quantize_nvfp4(torch.randn(8, 64))
    out = fp4_mm(qa.to(DEVICE), qb.to(DEVICE), method=method).cpu()
    assert bool(out[3].isnan().all()) and bool(out[torch.arange(16) != 3].isfinite().all())


def test_operand_checks():
    a = formats.quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(ValueError, match="K mismatch"):
        fp4_mm(a, formats.quantize_nvfp4(torch.randn(4, 64)))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_grouped_fp4_mm_is_one_fp4_mm_per_group(fmt):
    """Groups of 5, 0 and 37 rows (one empty), each with its own tensor scales, in one launch."""
    from fp4lab.kernels.gemm import grouped_fp4_mm
    g = torch.Generator().manual_seed(3)
    q = (lambda t, **kw: formats.quantize_mxfp4(t, pad=True)) if fmt == "mxfp4" else \
        (lambda t, **kw: formats.quantize_nvfp4(t, pad=True, **kw))
    qa = [q(torch.randn(m, 64, generator=g) * 4.0**e) for e, m in enumerate((5, 0, 37))]
    qb = [q(torch.randn(24, 64, generator=g) * 2.0**-e, block=(16, 16)) for e in range(3)]
    out = grouped_fp4_mm([a.to(DEVICE) for a in qa], [b.to(DEVICE) for b in qb], out_dtype=torch.float32).cpu()
    assert out.shape == (42, 24)
    start = 0
    for a, b in zip(qa, qb):
        m = a.shape[0]
        ref = formats.scaled_mm(a, b)
        assert bool(((out[start:start + m].double() - ref.double()).abs() <= _summation_bound(a, b) + 1e-30).all())
        start += m
    with pytest.raises(ValueError, match="as many"):
        grouped_fp4_mm(qa, qb[:2])
