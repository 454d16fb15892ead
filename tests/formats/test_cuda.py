"""The reference on CUDA gives the same bytes as on the CPU (run on the device machine)."""

import pytest
import torch

from fp4lab.formats import (hadamard_transform, quantize_mxfp4, quantize_nvfp4, random_bytes,
                            scaled_mm)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _same(a, b):
    assert torch.equal(a.codes.cpu(), b.codes) and torch.equal(a.scales.cpu().view(torch.uint8),
                                                                b.scales.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizers_match_cpu_bytes(dtype):
    x = (torch.randn(512, 1024) * torch.exp(3 * torch.randn(512, 1))).to(dtype)
    x[0, 3] = float("nan")
    for kwargs in [{}, {"profile": "torchao"}, {"block": (16, 16)}, {"axis": 0},
                   {"rounding": "stochastic", "seed": 77}]:
        _same(quantize_nvfp4(x.cuda(), **kwargs), quantize_nvfp4(x, **kwargs))
    for mode in ["floor", "ceil", "even", "rceil"]:
        _same(quantize_mxfp4(x.cuda(), mode=mode, rounding="stochastic", seed=3),
              quantize_mxfp4(x, mode=mode, rounding="stochastic", seed=3))


def test_a_cuda_generator_seeds_stochastic_rounding():
    g = torch.Generator("cuda").manual_seed(3)
    q = quantize_nvfp4(torch.randn(4, 32, device="cuda"), rounding="stochastic", seed=g)
    assert q.codes.is_cuda


def test_random_bytes_hadamard_and_gemm_match_cpu():
    assert torch.equal(random_bytes(123, 10_000, "cuda").cpu(), random_bytes(123, 10_000))
    x = torch.randn(256, 512).bfloat16()
    assert torch.equal(hadamard_transform(x.cuda(), signs="random", seed=4).cpu(),
                       hadamard_transform(x, signs="random", seed=4))
    qa, qb = quantize_nvfp4(x), quantize_nvfp4(torch.randn(128, 512))
    assert torch.equal(scaled_mm(qa.to("cuda"), qb.to("cuda")).cpu(), scaled_mm(qa, qb))


def test_a_decode_table_is_copied_before_capture_or_refused_clearly():
    from fp4lab.formats import codes

    codes_cuda = torch.arange(16, dtype=torch.uint8, device="cuda")
    codes._table_on.cache_clear()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="decode once on that device before capturing"):
        with torch.cuda.graph(graph):
            codes.decode_e2m1(codes_cuda)
    want = codes.decode_e2m1(codes_cuda)  # eagerly: the table is copied now
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = codes.decode_e2m1(codes_cuda)
    graph.replay()
    assert torch.equal(got, want)
