"""kernels.blas: the dense scaled GEMM on cuBLASLt (alpha read on the device), where it applies.

On the CPU: which operands it takes and the traced op's fake. On a GPU: matmul.scaled_mm takes it
at every layout the FP4 linear makes, and gives alpha * (A @ B^T) to fp32 summation order (to the
bit where every sum is exact), under a CUDA graph as well; operands it cannot read fall back.
"""

import pytest
import torch

from fp4lab.kernels import blas

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def test_an_operand_is_read_through_its_unit_stride_with_16_byte_rows():
    assert blas._layout(torch.zeros(8, 16, dtype=torch.bfloat16)) == (1, 16, 8, 16)  # K contiguous: op T
    assert blas._layout(torch.zeros(16, 8, dtype=torch.bfloat16).t()) == (0, 8, 16, 8)  # rows contiguous: op N
    assert blas._layout(torch.zeros(8, 64, dtype=torch.bfloat16)[:, :16]) == (1, 16, 8, 64)  # a wider row
    assert blas._layout(torch.zeros(8, 12, dtype=torch.bfloat16)) is None  # 24-byte rows
    assert blas._layout(torch.zeros(8, 16, 2, dtype=torch.bfloat16)[:, :, 0]) is None  # no unit stride


def test_no_plan_off_cuda_for_other_dtypes_or_when_switched_off(monkeypatch):
    a = torch.zeros(16, 16, dtype=torch.bfloat16)
    assert blas.plan(a, a, torch.bfloat16) is None  # the CPU
    if CUDA:
        c = a.cuda()
        assert blas.plan(c.half(), c.half(), torch.bfloat16) is None
        assert blas.plan(c, c, torch.float16) is None
        monkeypatch.setenv("FP4LAB_CUBLASLT", "0")
        assert blas.plan(c, c, torch.bfloat16) is None


def test_the_traced_op_has_the_output_of_the_call():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a, b = torch.empty(24, 32, dtype=torch.bfloat16), torch.empty(40, 32, dtype=torch.bfloat16)
        s = torch.empty((), dtype=torch.float32)
        for bf16, dtype in ((True, torch.bfloat16), (False, torch.float32)):
            out = torch.ops.fp4lab.lt_scaled_mm(a, b, [s, s], bf16)
            assert out.shape == (24, 40) and out.dtype == dtype and out.is_contiguous()


def test_the_traced_ops_body_keeps_each_calls_plan_and_falls_back_where_it_must(monkeypatch):
    """The op a compiled step calls once per GEMM: its plan found once per key of what the checks
    read (another layout is another key), cuBLASLt only while matmul.CUBLASLT is on (off: nothing
    kept, so turning it on finds the plan), scaled_mm wherever the plan cannot run the call."""
    from fp4lab.kernels import matmul
    from fp4lab.kernels.host import PlanTable
    monkeypatch.setattr(blas, "_RECORDED", PlanTable(8))
    done, planned, fallen = torch.zeros(2, 2), [], []

    class Plan:
        runs = []

        def run(self, a, b, scales):
            self.runs.append(len(scales))
            return None if a.data_ptr() % 16 else done
    monkeypatch.setattr(matmul, "dense_plan", lambda a, b, dtype, alphas: planned.append(b.stride()) or
                        type("P", (), {"lt": Plan()})())
    monkeypatch.setattr(matmul, "scaled_mm", lambda a, b, alpha, out_dtype: fallen.append(alpha) or "fallback")
    a, b, s = torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(48, 32, dtype=torch.bfloat16), torch.ones(())
    assert blas._lt_scaled_mm(a, b, [s, s], True) is done and blas._lt_scaled_mm(a, b, [s, s], True) is done
    assert planned == [(32, 1)] and Plan.runs == [2, 2]  # planned once
    assert blas._lt_scaled_mm(a, b.t().contiguous().t(), [s], True) is done and len(planned) == 2  # a new key
    monkeypatch.setattr(matmul, "CUBLASLT", False)
    c = torch.zeros(16, 32, dtype=torch.bfloat16)
    assert blas._lt_scaled_mm(c, b, [s], False) == "fallback" and len(planned) == 2 and fallen == [s]
    monkeypatch.setattr(matmul, "CUBLASLT", True)
    assert blas._lt_scaled_mm(c, b, [s], False) is done and len(planned) == 3  # nothing was kept while off
    shifted = torch.zeros(4 * 32 + 1, dtype=torch.bfloat16)[1:].view(4, 32)  # not 16-byte aligned
    assert blas._lt_scaled_mm(shifted, b, [], True) == "fallback" and fallen[-1] is None
    with pytest.raises(ValueError, match="at most two"):
        blas._lt_scaled_mm(a, b, [s, s, s], True)


def test_the_device_constants_are_real_memory_when_first_made_while_tracing():
    """A compiled model makes its first plans while torch.compile traces; the plan is kept for
    the run, so the alpha, beta and workspace it points cuBLASLt at must not be fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    with FakeTensorMode():  # (the uncached function: clearing the cache would free live plans' constants)
        made = blas._constants.__wrapped__(torch.device("cpu"))
    assert not any(isinstance(t, FakeTensor) for t in made)
    assert float(made[0]) == 1 and float(made[1]) == 0 and made[2].numel() == blas._WORKSPACE


def _counted(monkeypatch) -> list:
    """A list that gets an entry for every GEMM cuBLASLt runs."""
    calls, run = [], blas.LtPlan.run

    def counting(self, *args):
        out = run(self, *args)
        if out is not None:
            calls.append(out.shape)
        return out
    monkeypatch.setattr(blas.LtPlan, "run", counting)
    return calls


def _exact_values(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Block values as the quantizers write them (an E2M1 grid value times a power-of-two scale per
    16), small enough that every partial sum below is exact in fp32."""
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
    v = grid[torch.randint(0, 8, (rows, k), generator=g)] * (1 - 2 * torch.randint(0, 2, (rows, k), generator=g))
    scale = 2.0 ** torch.randint(-2, 3, (rows, k // 16, 1), generator=g)
    return (v.view(rows, -1, 16) * scale).view(rows, k).bfloat16()


def _layouts(t: torch.Tensor, row_major: bool) -> torch.Tensor:
    """t on the GPU, its rows padded to a wider stride (row-major) or stored column-major."""
    if row_major:
        padded = torch.zeros(t.shape[0], t.shape[1] + 64, dtype=t.dtype, device="cuda")
        padded[:, :t.shape[1]] = t.cuda()
        return padded[:, :t.shape[1]]
    return t.t().contiguous().t().cuda()


@gpu
@pytest.mark.parametrize("a_rows,b_rows", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("scales", [0, 1, 2])
def test_exact_sums_give_the_rounded_exact_product_at_every_layout(a_rows, b_rows, scales, monkeypatch):
    from fp4lab.kernels import matmul
    calls = _counted(monkeypatch)
    g = torch.Generator().manual_seed(scales + 2 * a_rows + 4 * b_rows)
    m, n, k = 272, 144, 512
    a, b = _exact_values(m, k, g), _exact_values(n, k, g)
    s = [torch.tensor(v, device="cuda") for v in (0.0173, 3.1e-4)][:scales]
    alpha = tuple(s) if scales == 2 else s[0] if s else None
    for dtype in (torch.bfloat16, torch.float32):
        got = matmul.scaled_mm(_layouts(a, a_rows), _layouts(b, b_rows), alpha, out_dtype=dtype)
        factor = (s[0] * s[1] if scales == 2 else s[0] if s else torch.tensor(1.0)).cpu()
        want = ((a.float() @ b.float().T) * factor).to(dtype)  # the fp32 sum is exact; one multiply, one rounding
        assert torch.equal(got.cpu(), want)
    assert len(calls) == 2  # cuBLASLt took both


@gpu
def test_an_output_whose_rows_are_not_16_byte_aligned_falls_back(monkeypatch):
    from fp4lab.kernels import matmul
    calls = _counted(monkeypatch)
    g = torch.Generator().manual_seed(5)
    a, b = _exact_values(64, 128, g), _exact_values(36, 128, g)  # 36 bf16 columns: 72-byte rows
    assert torch.equal(matmul.scaled_mm(a.cuda(), b.cuda(), None).cpu(), (a.float() @ b.float().T).bfloat16())
    assert not calls


@gpu
def test_the_output_is_not_read_when_beta_is_zero():
    """C is the fresh output (beta = 0 read from the device): memory left full of NaN by a freed
    tensor must not reach the result."""
    from fp4lab.kernels import matmul
    g = torch.Generator().manual_seed(6)
    a, b = _exact_values(512, 256, g).cuda(), _exact_values(384, 256, g).cuda()
    want = matmul.scaled_mm(a, b, None)
    for _ in range(3):
        poison = torch.full((512, 384), float("nan"), dtype=torch.bfloat16, device="cuda")
        del poison  # (its block goes back to the caching allocator, NaN and all)
        got = matmul.scaled_mm(a, b, None)
        assert not bool(got.isnan().any()) and torch.equal(got, want)


@gpu
def test_inexact_sums_are_within_fp32_summation_order_and_a_graph_replays_the_bits(monkeypatch):
    from fp4lab.kernels import matmul
    from .test_matmul import _bound, _operands
    calls = _counted(monkeypatch)
    a, b = _operands(1000, 384, 2048, 7)
    alpha = torch.tensor(0.37, device="cuda")
    out = matmul.scaled_mm(a.cuda(), b.cuda(), alpha, out_dtype=torch.float32).cpu()
    ref = (a.double() @ b.double().T) * 0.37
    assert bool(((out.double() - ref).abs() <= _bound(a, b, 0.37)).all())
    ac, bc = a.cuda(), b.cuda()
    eager = matmul.scaled_mm(ac, bc, alpha)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = matmul.scaled_mm(ac, bc, alpha)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    alpha.fill_(0.5)  # alpha is read when the GEMM runs
    graph.replay()
    assert torch.equal(captured, matmul.scaled_mm(ac, bc, alpha)) and not torch.equal(captured, eager)
    assert len(calls) == 4  # every call, the capture included (the plan was made before it)


@gpu
def test_operands_it_cannot_read_fall_back_to_the_triton_kernels(monkeypatch):
    from fp4lab.kernels import matmul
    calls = _counted(monkeypatch)
    g = torch.Generator().manual_seed(3)
    base = _exact_values(65, 256, g).cuda()
    a = base.view(-1)[8:8 + 64 * 256].view(64, 256)  # starts 16 bytes in: aligned
    b = base.view(-1)[4:4 + 32 * 256].view(32, 256)  # 8 bytes in: not aligned
    want = (a.float() @ b.float().T).bfloat16()
    assert torch.equal(matmul.scaled_mm(a, b, None), want) and not calls
    assert torch.equal(matmul.scaled_mm(a, a[:32], None), (a.float() @ a[:32].float().T).bfloat16()) and calls


@gpu
def test_a_long_contraction_into_a_small_output_splits_k_sums_in_fp32_and_applies_alpha_once(monkeypatch):
    """d12's [768, 768] weight gradient over 16,384 tokens, where cuBLASLt's algorithm splits K
    (a workspace): with values whose every partial sum is exact in fp32, the result must be the
    exact sum times alpha rounded once, bit for bit (a split summed in bf16, or alpha applied to
    each part, would differ), and the same bits on a second call."""
    from fp4lab.kernels import matmul
    calls = _counted(monkeypatch)
    g = torch.Generator().manual_seed(11)
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3])  # x {1, 2}, signed: |product| <= 36, sums exact below 2^22

    def values(rows):
        v = grid[torch.randint(0, 6, (rows, 16384), generator=g)] * (1 - 2 * torch.randint(0, 2, (rows, 16384), generator=g))
        return (v * torch.randint(1, 3, (rows, 16384), generator=g)).bfloat16()
    a, b = values(768), values(768)
    alpha = torch.tensor(0.37)
    want = ((a.double() @ b.double().T).float() * alpha).bfloat16()  # (the sum is exact: its fp32 value)
    ac, bc, alpha_c = a.cuda(), b.cuda(), alpha.cuda()
    first = matmul.scaled_mm(ac, bc, alpha_c)
    assert torch.equal(first.cpu(), want) and torch.equal(matmul.scaled_mm(ac, bc, alpha_c), first)
    plan = next(p for p in matmul._DENSE_PLANS.values() if getattr(p, "lt", None) is not None
                and p.mnk == (768, 768, 16384))
    assert plan.lt._algo.workspace > 0 and len(calls) == 2  # cuBLASLt ran it, split (measured: 1.6x faster)
