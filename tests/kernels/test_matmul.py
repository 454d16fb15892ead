"""kernels.matmul's Triton kernels: alpha * (A @ B^T) with FP32 accumulation, dense and grouped, against float64."""

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

triton = pytest.importorskip("triton")

from fp4lab.kernels import groups, matmul  # noqa: E402
from fp4lab.kernels.matmul import contraction_grouped_mm, grouped_scaled_mm, scaled_mm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _triton_kernels(monkeypatch):
    """These tests are of the Triton kernels: on a GPU, dense calls stay off cuBLASLt (test_blas.py)."""
    monkeypatch.setattr(matmul, "CUBLASLT", False)


def _bound(a, b, alpha):
    """fp32 summation of K products (exact in fp32: bf16 x bf16), then one alpha multiply."""
    k = a.shape[-1]
    return (2 * k * 2**-24 + 2**-23) * (a.double().abs() @ b.double().abs().T) * abs(float(alpha)) + 1e-30


def _operands(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).bfloat16()
    return a, torch.randn(n, k, generator=g).bfloat16()


@pytest.mark.parametrize("m,n,k", [(64, 64, 64), (70, 50, 96), (1, 300, 40), (33, 17, 200)])
def test_dense_matches_float64_to_summation_order(m, n, k):
    a, b = _operands(m, n, k, m + n + k)
    alpha = torch.tensor(0.37)
    out = scaled_mm(a.to(DEVICE), b.to(DEVICE), alpha.to(DEVICE), out_dtype=torch.float32).cpu()
    ref = (a.double() @ b.double().T) * 0.37
    assert out.shape == (m, n) and bool(((out.double() - ref).abs() <= _bound(a, b, 0.37)).all())
    # the bf16 output is the fp32 result rounded to nearest even, in the same kernel
    bf16 = scaled_mm(a.to(DEVICE), b.to(DEVICE), alpha.to(DEVICE)).cpu()
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, out.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_scales_are_their_product_and_none_is_one(dtype):
    """alpha given as (S_dec_A, S_dec_B) is multiplied in the epilogue: the bits of alpha = their
    fp32 product (scales whose product rounds, one subnormal); None scales by nothing (alpha 1)."""
    a, b = _operands(40, 72, 96, 5)
    a, b = a.to(DEVICE), b.to(DEVICE)
    for sa, sb in [(0.1, 0.3), (1 / 3, 7 / 11), (2.0**-70, 2.0**-60), (3e38, 0.5)]:
        pair = (torch.tensor(sa, device=DEVICE), torch.tensor(sb, device=DEVICE))
        got = scaled_mm(a, b, pair, out_dtype=dtype)
        assert torch.equal(got, scaled_mm(a, b, pair[0] * pair[1], out_dtype=dtype)), (sa, sb)
    one = torch.tensor(1.0, device=DEVICE)
    assert torch.equal(scaled_mm(a, b, None, out_dtype=dtype), scaled_mm(a, b, one, out_dtype=dtype))
    with pytest.raises(TypeError):
        scaled_mm(a, b, (one, one.double()))
    with pytest.raises(ValueError, match="pair"):
        scaled_mm(a, b, (one, one, one))


def test_strided_operands_give_the_same_result():
    a, b = _operands(48, 40, 64, 1)
    alpha = torch.tensor(1.0, device=DEVICE)
    want = scaled_mm(a.to(DEVICE), b.to(DEVICE), alpha, out_dtype=torch.float32)
    a_t, b_t = a.T.contiguous().to(DEVICE), b.T.contiguous().to(DEVICE)  # column-major views below
    assert torch.equal(scaled_mm(a_t.T, b_t.T, alpha, out_dtype=torch.float32), want)


def test_nan_and_inf_propagate():
    a, b = _operands(32, 32, 64, 2)
    a[3, 5] = float("nan")
    b[7, 9] = float("inf")
    out = scaled_mm(a.to(DEVICE), b.to(DEVICE), torch.tensor(1.0, device=DEVICE), out_dtype=torch.float32).cpu()
    ref = a.float() @ b.float().T
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())


@pytest.mark.parametrize("sizes,k", [([10, 0, 45, 15], 96), ([0, 0, 3], 64), ([64], 128), ([300, 7], 128)])
def test_grouped_is_one_scaled_mm_per_group(sizes, k):
    s, n = sum(sizes), 50
    a, _ = _operands(s, n, k, sum(sizes))
    g = torch.Generator().manual_seed(5)
    b = torch.randn(len(sizes), n, k, generator=g).bfloat16()
    alpha = torch.rand(len(sizes), generator=g) + 0.5
    out = grouped_scaled_mm(a.to(DEVICE), b.to(DEVICE), sizes, alpha.to(DEVICE), out_dtype=torch.float32).cpu()
    assert out.shape == (s, n)
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        ref = (a[rows].double() @ b[e].double().T) * float(alpha[e])
        assert bool(((out[rows].double() - ref).abs() <= _bound(a[rows], b[e], alpha[e])).all())
        start += size
    one = grouped_scaled_mm(a.to(DEVICE), b.to(DEVICE), sizes, torch.tensor(2.0, device=DEVICE),
                            out_dtype=torch.float32).cpu()
    unit = grouped_scaled_mm(a.to(DEVICE), b.to(DEVICE), sizes, torch.ones(len(sizes), device=DEVICE),
                             out_dtype=torch.float32).cpu()
    assert torch.equal(one, 2 * unit)  # a single alpha for every group (x2 is exact)
    strided = torch.stack([alpha, torch.full_like(alpha, 100.0)], 1)[:, 0]  # a view with stride 2
    got = grouped_scaled_mm(a.to(DEVICE), b.to(DEVICE), sizes, strided.to(DEVICE), out_dtype=torch.float32).cpu()
    assert torch.equal(got, out)
    shared = grouped_scaled_mm(a.to(DEVICE), b[:1].expand_as(b).to(DEVICE), sizes, alpha.to(DEVICE),
                               out_dtype=torch.float32).cpu()  # one B for all groups, stride 0
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        ref = (a[rows].double() @ b[0].double().T) * float(alpha[e])
        assert bool(((shared[rows].double() - ref).abs() <= _bound(a[rows], b[0], alpha[e])).all())
        start += size
    # B stored N-major per group (a transposed view), and B rows sliced out of padded storage
    b_nmajor = b.transpose(1, 2).contiguous().transpose(1, 2)
    b_sliced = torch.cat([b, torch.full((len(sizes), 14, k), float("nan")).bfloat16()], 1)[:, :n]
    for other in (b_nmajor, b_sliced):
        got = grouped_scaled_mm(a.to(DEVICE), other.to(DEVICE), sizes, alpha.to(DEVICE), out_dtype=torch.float32)
        start = 0
        for e, size in enumerate(sizes):
            rows = slice(start, start + size)
            ref = (a[rows].double() @ b[e].double().T) * float(alpha[e])
            assert bool(((got[rows].cpu().double() - ref).abs() <= _bound(a[rows], b[e], alpha[e])).all())
            start += size


@pytest.mark.parametrize("widths", [[32, 0, 96, 64], [7], [0, 0], [64, 200, 33], [128] * 5])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_contraction_grouped_is_one_scaled_mm_per_column_group(widths, layout, monkeypatch):
    """Each group's output is scaled_mm of its columns, bit for bit (the pointer kernel: the same
    summation), and float64's product to summation order; zero widths give zeros."""
    monkeypatch.setattr(matmul, "USE_TMA", False)
    m, n, s = 70, 50, sum(widths)
    g = torch.Generator().manual_seed(len(widths) + s)
    a = (torch.randn(m, s + 16, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).bfloat16()[:, 8: 8 + s]
    b = torch.randn(s, n, generator=g).bfloat16().T  # [N, S], S contiguous down a column: any strides
    if layout == "columns":
        a = a.T.contiguous().T
    alpha = torch.rand(len(widths), generator=g) + 0.5
    alpha[[e for e, w in enumerate(widths) if w == 0]] = float("inf")  # an empty group is zeros all the same
    for dtype in (torch.float32, torch.bfloat16):
        out = contraction_grouped_mm(a.to(DEVICE), b.to(DEVICE), widths, alpha.to(DEVICE), out_dtype=dtype).cpu()
        assert out.shape == (len(widths), m, n) and out.dtype == dtype
        start = 0
        for e, w in enumerate(widths):
            cols = slice(start, start + w)
            if w == 0:
                assert not out[e].any()
            else:
                one = scaled_mm(a[:, cols].to(DEVICE), b[:, cols].to(DEVICE), alpha[e].to(DEVICE), out_dtype=dtype)
                assert torch.equal(out[e], one.cpu())
                ref = (a[:, cols].double() @ b[:, cols].double().T) * float(alpha[e])
                bound = _bound(a[:, cols], b[:, cols], alpha[e]) + (ref.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
                assert bool(((out[e].double() - ref).abs() <= bound).all())
            start += w


def test_bad_arguments_are_refused():
    a, b = _operands(8, 8, 32, 3)
    one = torch.tensor(1.0)
    with pytest.raises(TypeError, match="bfloat16 operands"):
        scaled_mm(a.float(), b, one)
    with pytest.raises(ValueError, match="K mismatch"):
        scaled_mm(a, b[:, :16], one)
    with pytest.raises(TypeError, match="float32 tensor"):
        scaled_mm(a, b, one.double())
    with pytest.raises(ValueError, match="do not match"):
        grouped_scaled_mm(a, b[None], [3, 4], one)
    with pytest.raises(ValueError, match="alpha must hold"):
        grouped_scaled_mm(a, b[None].expand(2, 8, 32), [4, 4], torch.ones(3))
    with pytest.raises(ValueError, match="do not match"):
        contraction_grouped_mm(a, b, [16, 8], torch.ones(2))
    with pytest.raises(ValueError, match="alpha must hold"):
        contraction_grouped_mm(a, b, [16, 16], torch.ones(3))
    # device counts that are float, bool, too few, 2D
    for bad in (torch.tensor([4.0, 4.0]), torch.tensor([True, True]), torch.tensor([8]), torch.tensor([[4, 4]])):
        with pytest.raises(ValueError, match="as a tensor must be 2 int32/int64 counts"):
            grouped_scaled_mm(a, b[None].expand(2, 8, 32), bad, torch.ones(2))
    with pytest.raises(ValueError, match="widths as a tensor must be one or more int32/int64 counts"):
        contraction_grouped_mm(a, b, torch.tensor([16.0, 16.0]), torch.ones(2))
    with pytest.raises(ValueError, match="alpha must hold 2 values"):
        contraction_grouped_mm(a, b, torch.tensor([16, 16]), torch.ones(3))


_COUNTS = st.lists(st.integers(0, 70), min_size=1, max_size=6).filter(sum)


@settings(max_examples=25, deadline=None)
@given(sizes=_COUNTS, seed=st.integers(0, 2**16))
def test_device_counts_give_the_host_lists_bits(sizes, seed):
    """A routing's counts on the device (a tile list made there, sized for any split, no host
    read: what a CUDA graph can capture) give the bits of the same counts as a list, for the
    grouped GEMM (fprop, dgrad) and the contraction (wgrad), empty groups included."""
    g = torch.Generator().manual_seed(seed)
    s, k, n = sum(sizes), 40, 24
    a = torch.randn(s, k, generator=g).bfloat16().to(DEVICE)
    b = torch.randn(len(sizes), n, k, generator=g).bfloat16().to(DEVICE)
    alpha = (torch.rand(len(sizes), generator=g) + 0.5).to(DEVICE)
    counts = torch.tensor(sizes, device=DEVICE)
    assert torch.equal(grouped_scaled_mm(a, b, counts, alpha), grouped_scaled_mm(a, b, sizes, alpha))
    x, dy = torch.randn(k, s, generator=g).bfloat16().to(DEVICE), torch.randn(n, s, generator=g).bfloat16().to(DEVICE)
    alpha[[e for e, w in enumerate(sizes) if w == 0]] = float("inf")  # an empty group is zeros either way
    assert torch.equal(contraction_grouped_mm(x, dy, counts, alpha), contraction_grouped_mm(x, dy, sizes, alpha))


@pytest.mark.parametrize("widths", [[64, 0, 128], [192], [0, 64, 0, 64, 0]])
def test_device_widths_give_the_unmasked_contractions_bits(widths):
    """Widths of whole BK tiles (32 interpreted, 64 on the GPU): the list path contracts without
    masks (EVEN_K), the device path with masks that are all true, the same bits."""
    g = torch.Generator().manual_seed(sum(widths))
    x, dy = (torch.randn(n, sum(widths), generator=g).bfloat16().to(DEVICE) for n in (40, 24))
    alpha = torch.rand(len(widths), generator=g) + 0.5
    alpha[[e for e, w in enumerate(widths) if w == 0]] = float("inf")  # (an empty group is zeros all the same)
    alpha = alpha.to(DEVICE)
    device = contraction_grouped_mm(x, dy, torch.tensor(widths, device=DEVICE), alpha)
    assert torch.equal(device, contraction_grouped_mm(x, dy, widths, alpha))
    assert all(bool((device[e].view(torch.int16) == 0).all()) for e, w in enumerate(widths) if w == 0)  # +0.0


@settings(max_examples=200, deadline=None)
@given(sizes=_COUNTS, bm=st.sampled_from([16, 32, 256]))
def test_a_device_tile_list_is_the_host_list_then_empty_tiles(sizes, bm):
    """The device list's live tiles are the host list's, in order; the rest (the bound covers any
    split of the rows) have an empty row range, so their programs store nothing."""
    group, row, end = matmul._host_tiles(sizes, bm, torch.device("cpu"))
    d_group, d_row, d_end = groups.tiles(torch.tensor(sizes, device=DEVICE), sum(sizes), bm)
    live = group.numel()
    d_group, d_row, d_end = d_group.cpu(), d_row.cpu(), d_end.cpu()
    assert d_group.numel() >= live and torch.equal(d_end, end)
    assert torch.equal(d_group[:live], group) and torch.equal(d_row[:live], row)
    assert bool((d_row[live:] >= d_end[d_group[live:].long()]).all())


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(-40, 200), min_size=1, max_size=6), rows=st.integers(1, 300),
       bm=st.sampled_from([16, 32, 256]))
def test_a_device_tile_list_from_wrong_counts_stays_inside_the_rows(sizes, rows, bm):
    """Counts that do not sum to the rows (negative, too many: a bug upstream) are clamped: every
    group end and every tile's row range lies inside the rows, and the live tiles are the host
    list's for the clamped sizes."""
    group, row, end = (t.cpu() for t in groups.tiles(torch.tensor(sizes, device=DEVICE), rows, bm))
    clamped, left = [], rows
    for size in sizes:
        clamped.append(min(max(size, 0), left))
        left -= clamped[-1]
    h_group, h_row, h_end = matmul._host_tiles(clamped, bm, torch.device("cpu"))
    live = h_group.numel()
    assert torch.equal(end, h_end) and bool((end <= rows).all()) and bool((row <= rows).all())
    assert torch.equal(group[:live], h_group) and torch.equal(row[:live], h_row)
    assert bool((row[live:] >= end[group[live:].long()]).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_grouped_gemms_on_device_counts_are_captured_and_replay_new_counts():
    """Captured once, the launches replay with other counts written into the same tensor (the
    routing of a later step): each replay gives the eager list path's bits."""
    g = torch.Generator().manual_seed(9)
    s, k, n, e = 1024, 256, 128, 8  # widths of whole 64-column tiles below: the list path's EVEN_K
    a, b = torch.randn(s, k, generator=g).bfloat16().cuda(), torch.randn(e, n, k, generator=g).bfloat16().cuda()
    x, dy = torch.randn(k, s, generator=g).bfloat16().cuda(), torch.randn(n, s, generator=g).bfloat16().cuda()
    alpha = (torch.rand(e, generator=g) + 0.5).cuda()
    counts = torch.full((e,), s // e, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) off the capture
        grouped_scaled_mm(a, b, counts, alpha), contraction_grouped_mm(x, dy, counts, alpha)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, wgrad = grouped_scaled_mm(a, b, counts, alpha), contraction_grouped_mm(x, dy, counts, alpha)
    for sizes in ([s // e] * e, [0, 256, 0, 0, 64, 704, 0, 0], [0, 300, 0, 0, 1, 723, 0, 0], [s] + [0] * (e - 1)):
        counts.copy_(torch.tensor(sizes))
        graph.replay()
        assert torch.equal(out, grouped_scaled_mm(a, b, sizes, alpha))
        assert torch.equal(wgrad, contraction_grouped_mm(x, dy, sizes, alpha))


def test_the_gemm_sweep_lists_a_blocks_fifteen_gemms_and_restores_the_tile():
    """benchmarks/sweep_gemm.py: one GPT block's five linears, each with fprop, dgrad and wgrad
    shapes (d12: gate and up share theirs, and down's mirror them), and the tile and kernel it sets
    are the module's again after, an error inside included."""
    import importlib
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sweep = importlib.import_module("benchmarks.sweep_gemm")
    shapes = sweep.block_gemms(768, 2048, 2304, 16384)
    assert sum(shapes.values()) == 15
    assert shapes[(16384, 768, 2048)] == 3  # gate's and up's fprop, down's dgrad
    assert shapes[(16384, 2048, 768)] == 3  # down's fprop, gate's and up's dgrad
    assert shapes[(2048, 16384, 768)] == 2 and shapes[(768, 16384, 2048)] == 1  # gate's, up's and down's wgrad
    assert shapes[(768, 16384, 768)] == 1 and shapes[(2304, 16384, 768)] == 1  # proj's and qkv's wgrad

    def state():
        return (matmul._BM, matmul._BN, matmul._BK, matmul._WARPS, matmul._STAGES, matmul._LARGE_OUT,
                matmul._SMALL_OUT, matmul._TINY_OUT, matmul.PERSISTENT)
    before = state()
    with pytest.raises(RuntimeError):
        with sweep.tile((64, 64, 64, 4, 4), persistent=not matmul.PERSISTENT):
            assert state() == (64, 64, 64, 4, 4, *[(64, 64, 64, 4, 4)] * 3, not before[-1])
            raise RuntimeError("a tile that does not fit")
    assert state() == before


def test_a_dense_launch_takes_its_output_sizes_tile(monkeypatch):
    """On a GPU (132 SMs here): a large output (at least as many 256 x 128 tiles as SMs) the default
    tile, or the persistent kernel's; a weight gradient's small output 128 x 128 tiles, and one of
    fewer 128 x 128 tiles than half the SMs 64 x 128; a grouped launch always the default (its
    tile lists are made for BM). Every one steps through K by the same BK: the same bits."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(matmul, "sm_count", lambda device: 132)
    default = (matmul._BM, matmul._BN, matmul._BK, matmul._WARPS, matmul._STAGES)
    assert matmul._config(768, 768, False, "cuda") == matmul._TINY_OUT  # 36 tiles of 128 x 128
    assert matmul._config(2304, 768, False, "cuda") == matmul._SMALL_OUT  # 9 x 6 = 54 tiles of 256 x 128
    assert matmul._config(16384, 768, False, "cuda") == default  # 64 x 6 = 384 tiles
    assert matmul._config(16384, 768, False, "cuda", persistent=True) == matmul._LARGE_OUT
    assert matmul._config(768, 768, True, "cuda") == default
    assert matmul._config(768, 768, True, "cuda", persistent=True) == default
    assert {t[2] for t in (matmul._LARGE_OUT, matmul._SMALL_OUT, matmul._TINY_OUT)} == {matmul._BK}


def test_the_dense_gemm_gives_the_same_bits_at_any_tile(monkeypatch):
    """A tile is a schedule: with BK fixed, every (BM, BN) sums each output element in the same
    order, so the small-output tile cannot change a result (interpreted here; the H100 sweep,
    benchmarks/sweep_gemm.py, checked the same on the device)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, 256, generator=g).to(torch.bfloat16).to(DEVICE)  # several K steps, ragged M and N
    b = torch.randn(200, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    alpha = torch.tensor(0.75, device=DEVICE)
    want = scaled_mm(a, b, alpha)
    bk = matmul._config(300, 200, False, a.device)[2]
    # on a GPU the tiles the sweep measured (one MMA kind: warpgroup tiles); interpreted, small ones
    tiles = ([(256, 128, 8, 4), (128, 128, 8, 4), (64, 64, 4, 4)] if a.is_cuda else
             [(16, 32, 4, 2), (64, 16, 4, 2), (32, 64, 4, 2)])
    for persistent in (False, True):  # (on a GPU both dense kernels; the interpreter has the one)
        monkeypatch.setattr(matmul, "PERSISTENT", persistent)
        for bm, bn, warps, stages in tiles:
            monkeypatch.setattr(matmul, "_config", lambda m, n, grouped, device, persistent=False,
                                t=(bm, bn, bk, warps, stages): t)
            assert torch.equal(scaled_mm(a, b, alpha), want), (bm, bn, persistent)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the persistent kernel reads through TMA: a GPU")
@pytest.mark.parametrize("m,n,k", [(300, 200, 256), (1024, 768, 768), (16, 40, 48), (2048, 256, 1000), (4200, 4100, 200)])
@pytest.mark.parametrize("b_layout", ["k_major", "n_major"])
def test_the_persistent_kernel_gives_the_tiled_kernels_bits(m, n, k, b_layout, monkeypatch):
    """matmul.PERSISTENT changes the schedule (one program an SM, each walking output tiles), not
    a sum: every output element, bf16 or fp32, has the one-program-a-tile kernel's bits, for ragged
    M and N, a K that is no multiple of BK, and either layout of b (dgrad multiplies W as stored)."""
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    b = torch.randn(n, k, generator=g).to(torch.bfloat16).cuda()
    if b_layout == "n_major":
        b = b.T.contiguous().T
    alpha = torch.tensor(0.375, device="cuda")
    for out_dtype in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(matmul, "PERSISTENT", False)
        want = scaled_mm(a, b, alpha, out_dtype=out_dtype)
        monkeypatch.setattr(matmul, "PERSISTENT", True)
        assert torch.equal(scaled_mm(a, b, alpha, out_dtype=out_dtype), want), out_dtype


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's run of the persistent loop "
                    "(on a GPU, test_the_persistent_kernel_gives_the_tiled_kernels_bits)")
@pytest.mark.parametrize("m,n,k", [(50, 72, 40), (16, 16, 16), (200, 36, 20)])
@pytest.mark.parametrize("programs", [1, 3, 5])
@pytest.mark.parametrize("b_kn", [False, True])
@pytest.mark.parametrize("device_desc", [False, True])
def test_the_persistent_loop_visits_every_tile_once(m, n, k, programs, b_kn, device_desc):
    """The flattened loop's bookkeeping (a program's next tile every K steps, ragged M and N, a K
    that is no multiple of BK, fewer programs than tiles), run by the interpreter on small tiles
    through host tensor descriptors, or (DEVICE_DESC, a traced launch's) descriptors the kernel
    makes from the matrices: small integers, so every product and sum is exact."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randint(-3, 4, (m, k), generator=g).float()
    b = torch.randint(-3, 4, (n, k), generator=g).float()
    out = torch.full((m, n), float("nan"))
    programs = min(programs, triton.cdiv(m, 16) * triton.cdiv(n, 32))
    b_mat = b.T.contiguous() if b_kn else b
    a_arg, b_arg = (a, b_mat) if device_desc else (
        TensorDescriptor.from_tensor(a, [16, 16]), TensorDescriptor.from_tensor(b_mat, [16, 32] if b_kn else [32, 16]))
    matmul._scaled_mm_persistent_kernel[(programs,)](
        a_arg, b_arg, out, torch.tensor([0.5]), torch.tensor([0.25]), m, n, k, out.stride(0), out.stride(1),
        programs, a.stride(0), b_mat.stride(0), B_KN=b_kn, BF16_OUT=False, BM=16, BN=32, BK=16, GROUP_M=2, ALPHA=2,
        DEVICE_DESC=device_desc)
    assert torch.equal(out, (a @ b.T) * 0.125)


def test_calls_of_one_shape_and_another_layout_or_width_each_get_their_own_plan():
    """A dense call's plan (tile, kernel) is kept per shape and layout: the same a with b K-major,
    N-major, shifted off 16-byte alignment (TMA's condition, per call) or a narrower b each gives
    what a fresh call gives, and a plan reused with new operands computes with them."""
    a, b = _operands(48, 40, 64, 2)
    alpha = torch.tensor(0.5, device=DEVICE)
    a, b = a.to(DEVICE), b.to(DEVICE)
    want = scaled_mm(a, b, alpha, out_dtype=torch.float32)
    assert torch.equal(scaled_mm(a, b.T.contiguous().T, alpha, out_dtype=torch.float32), want)
    shifted = torch.empty(b.numel() + 1, dtype=b.dtype, device=DEVICE)[1:].view_as(b)  # 2 bytes in
    shifted.copy_(b)
    assert torch.equal(scaled_mm(a, shifted, alpha, out_dtype=torch.float32), want)
    assert torch.equal(scaled_mm(a, b[:24], alpha, out_dtype=torch.float32), want[:, :24])
    a2, b2 = (t.to(DEVICE) for t in _operands(48, 40, 64, 3))
    ref = (a2.double() @ b2.double().T) * 0.5
    got = scaled_mm(a2, b2, alpha, out_dtype=torch.float32)
    assert bool(((got.double() - ref).abs() <= _bound(a2.cpu(), b2.cpu(), 0.5).to(DEVICE)).all())


def test_a_dense_plan_follows_the_tile_settings(monkeypatch):
    """A dense plan is keyed by the tile settings it was made under (and by _config itself): a
    sweep that changes them launches the new tile."""
    a, b = (t.to(DEVICE) for t in _operands(96, 80, 64, 4))
    alpha = torch.tensor(1.0, device=DEVICE)
    monkeypatch.setattr(matmul, "PERSISTENT", False)
    want = scaled_mm(a, b, alpha)
    monkeypatch.setattr(matmul, "_config", lambda m, n, grouped, device, persistent=False: (16, 16, 32, 4, 2))
    assert torch.equal(scaled_mm(a, b, alpha), want)
    assert any(plan.pointer_grid == (6 * 5,) for plan in matmul._DENSE_PLANS.values())  # 96 / 16 x 80 / 16 tiles
