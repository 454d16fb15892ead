"""Triton quantize / dequantize kernels: the same bytes as fp4lab.formats on every path.

On a machine without a GPU these run in Triton's interpreter (tests/conftest.py), at small sizes;
on the device machine the same tests run on CUDA.
"""

import itertools
import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

pytest.importorskip("triton")

from fp4lab import formats, kernels  # noqa: E402
from fp4lab.kernels.amax import finite_amax  # noqa: E402
from fp4lab.kernels.host import PlanTable  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same(fast, ref):
    assert fast.codes.shape == ref.codes.shape and fast.scales.shape == ref.scales.shape
    assert torch.equal(fast.codes.cpu(), ref.codes)
    assert torch.equal(fast.scales.cpu().view(torch.uint8), ref.scales.view(torch.uint8))
    if ref.tensor_scale is not None:
        assert fast.tensor_scale.item() == ref.tensor_scale.item()
    assert (fast.shape, fast.axis, fast.block, fast.format) == (ref.shape, ref.axis, ref.block, ref.format)


def hard_input(shape, seed, dtype=torch.float32):
    """Log-normal row magnitudes (underflowing and saturating blocks), zeros, NaN, Inf, subnormals."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(shape[0], *[1] * (len(shape) - 1), generator=g)
    x = torch.randn(shape, generator=g) * torch.exp(4 * rows)
    flat = x.view(-1)
    if flat.numel() >= 200:
        flat[:16] = 0
        flat[40:56] = 1e-40 * torch.randn(16, generator=g)  # fp32 subnormals
        flat[100] = math.nan
        flat[150] = -math.inf
    return x.to(dtype)


NVFP4_CASES = [dict(), dict(profile="torchao"), dict(block=(16, 16)), dict(axis=0),
               dict(axis=0, block=(16, 16)), dict(rounding="stochastic", seed=7),
               dict(axis=0, rounding="stochastic", seed=2**40 + 3, profile="torchao"),
               dict(global_amax=3.0), dict(global_amax=0.0),
               dict(axis=0, hadamard="te", rounding="stochastic", seed=3),
               dict(hadamard="random", hadamard_seed=77, profile="torchao"),
               dict(axis=0, hadamard="none", global_amax=50.0),
               dict(profile="four_over_six"), dict(profile="four_over_six", block=(16, 16), axis=0),
               dict(profile="four_over_six", rounding="stochastic", seed=9, hadamard="random", hadamard_seed=4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kwargs", NVFP4_CASES, ids=[str(c) for c in NVFP4_CASES])
def test_nvfp4_matches_reference(kwargs, dtype):
    x = hard_input((96, 160), 1, dtype)
    if dtype == torch.float16:
        x = x.nan_to_num(nan=1.0, posinf=6e4, neginf=-6e4).clamp(-6e4, 6e4)
    assert_same(kernels.quantize_nvfp4(x.to(DEVICE), backend="triton", **kwargs),
                formats.quantize_nvfp4(x, **kwargs))


@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
@pytest.mark.parametrize("kwargs", [dict(), dict(axis=0), dict(rounding="stochastic", seed=11)], ids=str)
def test_mxfp4_matches_reference(mode, kwargs):
    x = hard_input((64, 192), 2, torch.bfloat16)
    assert_same(kernels.quantize_mxfp4(x.to(DEVICE), mode=mode, backend="triton", **kwargs),
                formats.quantize_mxfp4(x, mode=mode, **kwargs))


MXFP4_ROTATIONS = [dict(hadamard="none"), dict(axis=0, hadamard="none", rounding="stochastic", seed=9),
                   dict(hadamard="random", hadamard_seed=31), dict(axis=0, hadamard="random", hadamard_seed=2**40 + 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", MXFP4_ROTATIONS, ids=str)
def test_mxfp4_fused_32_point_hadamard_matches_reference(kwargs, dtype):
    # the 32-point butterfly in the kernel sums in the reference's order: the same bytes, not
    # merely close ones (the rotated values before rounding to bf16 are compared through them)
    x = hard_input((64, 192), 12, dtype)
    assert_same(kernels.quantize_mxfp4(x.to(DEVICE), backend="triton", **kwargs),
                formats.quantize_mxfp4(x, **kwargs))
    assert_same_values(kernels.quantize_values(x.to(DEVICE), "mxfp4", backend="triton", **kwargs),
                       kernels.BlockValues.of(formats.quantize_mxfp4(x, **kwargs)))


def test_mxfp4_hadamard_is_rotate_then_quantize():
    x = hard_input((32, 64), 13, torch.bfloat16)
    rotated = formats.hadamard_transform(x, size=32, signs="random", seed=4)
    assert_same(formats.quantize_mxfp4(x, hadamard="random", hadamard_seed=4), formats.quantize_mxfp4(rotated))
    with pytest.raises(ValueError, match="TE's sign vector"):
        kernels.quantize_mxfp4(x.to(DEVICE), hadamard="te", backend="triton")


@settings(max_examples=15, deadline=None)
@given(lead=st.lists(st.integers(0, 5), min_size=0, max_size=2), length=st.integers(1, 70),
       seed=st.integers(0, 1000), fmt=st.sampled_from(["nvfp4", "nvfp4-2d", "mxfp4"]),
       sr=st.booleans())
def test_ragged_shapes_with_padding(lead, length, seed, fmt, sr):
    shape = (*lead, length) if fmt != "nvfp4-2d" else (max(1, sum(lead) + 1) * 7, length)
    x = hard_input(shape if shape[0] else (1, length), seed)[: shape[0]] if shape[0] else torch.zeros(shape)
    kw = dict(pad=True, rounding="stochastic" if sr else "rtne", seed=seed)
    if fmt == "mxfp4":
        fast, ref = kernels.quantize_mxfp4(x.to(DEVICE), backend="triton", **kw), formats.quantize_mxfp4(x, **kw)
    else:
        kw["block"] = (16, 16) if fmt == "nvfp4-2d" else 16
        fast, ref = kernels.quantize_nvfp4(x.to(DEVICE), backend="triton", **kw), formats.quantize_nvfp4(x, **kw)
    assert_same(fast, ref)
    if x.numel():  # the same quantize written as block values ([rows, Lp] whatever x's rank)
        assert_same_values(kernels.quantize_values(x.to(DEVICE), "mxfp4" if fmt == "mxfp4" else "nvfp4",
                                                   backend="triton", **kw), kernels.BlockValues.of(ref))


def assert_same_values(fast, ref):
    """BlockValues: the same bf16 bits (NaN blocks as NaN), rows and tensor scale."""
    assert fast.values.shape == ref.values.shape and fast.rows == ref.rows
    f, r = fast.values.cpu().float(), ref.values.cpu().float()
    assert torch.equal(f.isnan(), r.isnan()) and torch.equal(f.nan_to_num(0.5), r.nan_to_num(0.5))
    assert (fast.tensor_scale is None) == (ref.tensor_scale is None)
    if ref.tensor_scale is not None:
        assert fast.tensor_scale.item() == ref.tensor_scale.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", NVFP4_CASES + [dict(block=(16, 16), axis=0, pad=True)], ids=str)
def test_block_values_in_the_quantize_pass_match_reference(kwargs, dtype):
    x = hard_input((96, 160), 6, dtype)
    assert_same_values(kernels.quantize_values(x.to(DEVICE), "nvfp4", backend="triton", **kwargs),
                       kernels.BlockValues.of(formats.quantize_nvfp4(x, **kwargs)))


@pytest.mark.parametrize("kwargs", [dict(), dict(rounding="stochastic", seed=4)], ids=str)
def test_torchao_at_a_tiny_amax_matches_reference(kwargs):
    """torchao's e_b = (1 / S_dec) / s_b is not clamped: below an amax of ~5e-34 it is Inf, and a
    zero element (signed, or the padding) gives 0 * Inf = NaN, which the reference encodes as +6.
    The codes and the block values say the same, for +0 and -0."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(16, 72, generator=g) * 1e-36
    x[:, ::5], x[:, 1::7] = 0.0, -0.0
    x[:8, 16:32], x[8:, 16:32] = 0.0, -0.0  # whole blocks of zeros: s_b = 2^-6, e_b = Inf
    kw = dict(profile="torchao", pad=True, **kwargs)
    assert_same(kernels.quantize_nvfp4(x.to(DEVICE), backend="triton", **kw), formats.quantize_nvfp4(x, **kw))
    assert_same_values(kernels.quantize_values(x.to(DEVICE), "nvfp4", backend="triton", **kw),
                       kernels.BlockValues.of(formats.quantize_nvfp4(x, **kw)))


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("kwargs", [dict(), dict(axis=0, rounding="stochastic", seed=5)], ids=str)
def test_mxfp4_block_values_match_reference(mode, kwargs):
    x = hard_input((64, 96), 7, torch.bfloat16)
    assert_same_values(kernels.quantize_values(x.to(DEVICE), "mxfp4", mode=mode, backend="triton", **kwargs),
                       kernels.BlockValues.of(formats.quantize_mxfp4(x, mode=mode, **kwargs)))


def test_nd_axis_and_non_contiguous_input():
    x = hard_input((4, 32, 48), 3)
    assert_same(kernels.quantize_nvfp4(x.to(DEVICE), axis=1, backend="triton"), formats.quantize_nvfp4(x, axis=1))
    xt = x[:, :, :32].transpose(1, 2)  # a strided view
    assert_same(kernels.quantize_nvfp4(xt.to(DEVICE), backend="triton"), formats.quantize_nvfp4(xt))


def test_amax_pass_ignores_non_finite():
    x = hard_input((64, 64), 4)
    ref = formats.blocks.finite_amax(x)
    assert finite_amax(x.to(DEVICE)).item() == ref.item()
    assert finite_amax(torch.full((3,), math.nan, device=DEVICE)).item() == 0


@pytest.mark.parametrize("launch", [(1024, 2, 4), (4096, 16, 8), (128, 1, 1)], ids=str)
def test_the_amax_pass_gives_the_same_amax_at_any_launch_shape(launch, monkeypatch):
    """kernels.amax.AMAX_LAUNCH (benchmarks/sweep_amax.py's knob) moves only the work between programs:
    chunks that end mid-iteration, a last chunk past the end, one program for all."""
    from fp4lab.kernels import amax
    x = hard_input((3, 80, 96), 6, torch.bfloat16)
    ref = formats.blocks.finite_amax(x)
    monkeypatch.setattr(amax, "AMAX_LAUNCH", launch)
    assert finite_amax(x.to(DEVICE)).item() == ref.item()
    assert finite_amax(x[:, :, :50].to(DEVICE)).item() == formats.blocks.finite_amax(x[:, :, :50]).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_and_fake_quantize_match(dtype):
    x = hard_input((3, 64, 96), 5)
    for q in [formats.quantize_nvfp4(x, axis=1), formats.quantize_mxfp4(x),
              formats.with_scale_layout(formats.quantize_nvfp4(x[0], block=(16, 16), axis=0), "swizzled")]:
        fast = kernels.dequantize(q.to(DEVICE), dtype, backend="triton").cpu()
        ref = formats.dequantize(q, dtype)
        assert fast.shape == ref.shape and torch.equal(fast.nan_to_num(0.5), ref.nan_to_num(0.5))
    y = x.to(dtype).nan_to_num(0.0, 1e4, -1e4)
    fq = kernels.fake_quantize(y.to(DEVICE), "mxfp4", mode="rceil", backend="triton").cpu()
    assert fq.dtype == dtype and torch.equal(fq, formats.dequantize(formats.quantize_mxfp4(y, mode="rceil"), dtype))


def test_backend_choice(monkeypatch):
    x = torch.randn(4, 32)
    assert torch.equal(kernels.quantize_nvfp4(x).codes, formats.quantize_nvfp4(x).codes)  # CPU: reference
    with pytest.raises(ValueError, match="'auto', 'reference', 'triton'"):
        kernels.quantize_nvfp4(x, backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if DEVICE == "cpu":
        with pytest.raises(RuntimeError, match="CUDA tensor or TRITON_INTERPRET=1"):
            kernels.quantize_nvfp4(x, backend="triton")
    qx, qw = formats.quantize_nvfp4(x), formats.quantize_nvfp4(torch.randn(8, 32))
    assert torch.equal(kernels.fp4_mm(qx, qw), formats.emulated_mm(qx, qw))  # CPU: the reference
    monkeypatch.setenv("FP4LAB_BACKEND", "reference")
    assert torch.equal(kernels.quantize_mxfp4(x.to(DEVICE)).codes.cpu(), formats.quantize_mxfp4(x).codes)


def test_bad_input_errors_come_from_the_shared_checks():
    with pytest.raises(ValueError, match="block size 16"):
        kernels.quantize_nvfp4(torch.randn(3, 20, device=DEVICE), backend="triton")
    with pytest.raises(TypeError, match="int64"):
        kernels.quantize_mxfp4(torch.ones(3, 32, dtype=torch.int64, device=DEVICE), backend="triton")
    q = formats.quantize_nvfp4(torch.randn(4, 32))
    for backend in ("reference", "triton"):  # an integer dtype would truncate the values silently
        with pytest.raises(TypeError, match="floating dtype"):
            kernels.dequantize(q if backend == "reference" else q.to(DEVICE), torch.int8, backend=backend)


def test_repeated_calls_of_one_shape_reuse_a_plan_and_still_give_the_references_bytes():
    """The quantize keeps what it works out per call shape (kernels.quantize's plans): later calls
    of that shape with other values, another layout, another axis or seed give the reference's
    bytes, and bad input is refused at every call, not only the first."""
    for seed in range(3):
        x = hard_input((32, 64), seed)
        for kw in (dict(block=(16, 16)), dict(rounding="stochastic", seed=seed), dict(axis=0),
                   dict(hadamard="random", hadamard_seed=seed + 7)):
            assert_same(kernels.quantize_nvfp4(x.to(DEVICE), backend="triton", **kw), formats.quantize_nvfp4(x, **kw))
        xt = x.T.contiguous().T  # the same values and shape, column-major
        assert_same(kernels.quantize_nvfp4(xt.to(DEVICE), backend="triton"), formats.quantize_nvfp4(x))
    for _ in range(2):
        with pytest.raises(ValueError, match="block size 16"):
            kernels.quantize_nvfp4(torch.randn(3, 20, device=DEVICE), backend="triton")


def test_a_plan_follows_the_tile_settings_and_takes_no_float_axis(monkeypatch):
    """A plan is keyed by the tile it was made with: a sweep that changes TILES or PAIR_TILE
    launches the new tile (the bytes the same); and an axis that is no index is refused whatever
    was planned for the index it equals."""
    from fp4lab.kernels import quantize
    x = hard_input((64, 256), 1)
    ref = formats.quantize_nvfp4(x)
    assert_same(kernels.quantize_nvfp4(x.to(DEVICE), backend="triton"), ref)
    monkeypatch.setitem(quantize.TILES, "rows", (16, 64, 2))
    assert_same(kernels.quantize_nvfp4(x.to(DEVICE), backend="triton"), ref)
    assert any(plan.grid == (4, 4) for plan in quantize._LAUNCH_PLANS.values())  # 64 / 16 rows, 256 / 64 columns
    pair = dict(rows=dict(rounding="rtne"), columns=dict(rounding="rtne"), columns_len=64, backend="triton")
    want = kernels.quantize_values_pair(x.to(DEVICE), "nvfp4", **pair)
    monkeypatch.setattr(quantize, "PAIR_TILE", (32, 64, 4))
    got = kernels.quantize_values_pair(x.to(DEVICE), "nvfp4", **pair)
    assert any(p.grid(1) == (2, 4) for p in quantize._PAIR_PLANS.values())
    for w, g in zip(want, got):
        assert torch.equal(w.values.view(torch.int16), g.values.view(torch.int16))  # (NaN blocks: bits)
        assert torch.equal(w.tensor_scale, g.tensor_scale)
    kernels.quantize_nvfp4(x.to(DEVICE), axis=1, backend="triton")
    with pytest.raises(TypeError):
        kernels.quantize_nvfp4(x.to(DEVICE), axis=1.0, backend="triton")


def test_uncovered_shapes_fall_back_to_the_reference_with_one_warning():
    import warnings
    from fp4lab.kernels import _warned
    _warned.clear()
    x = torch.randn(32, 48, dtype=torch.float16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):  # fp16 input to the fused Hadamard: the reference's path, the same bytes
            assert_same(kernels.quantize_nvfp4(x.to(DEVICE), hadamard="te", backend="triton"),
                        formats.quantize_nvfp4(x, hadamard="te"))
    assert len([w for w in seen if "reference" in str(w.message)]) == 1


GROUPED_CASES = [("nvfp4", dict(block=(1, 16), profile="te")), ("nvfp4", dict(block=(1, 16), profile="torchao")),
                 ("nvfp4", dict(block=(1, 16), profile="four_over_six")), ("nvfp4", dict(block=(16, 16), profile="te")),
                 ("nvfp4", dict(block=(16, 16), profile="four_over_six")), ("mxfp4", dict(mode="floor")),
                 ("mxfp4", dict(mode="rceil"))]


@settings(max_examples=20, deadline=None)
@given(case=st.sampled_from(GROUPED_CASES), sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5),
       length=st.integers(1, 70), seed=st.integers(0, 1000), sr=st.booleans(), bf16=st.booleans())
def test_grouped_quantize_is_each_group_quantized_alone(case, sizes, length, seed, sr, bf16):
    """One launch for every group (MoE experts' rows back to back) writes, per group, the bytes of
    quantizing that group alone with its own seed: its own amax and S_dec, its Philox counted
    from its first row."""
    fmt, knobs = case
    if knobs.get("block", (1, 16))[0] == 16:
        sizes = [16 * (1 + n % 3) for n in sizes]  # 16x16 tiles must not straddle two groups
    x = hard_input((sum(sizes), length), seed, torch.bfloat16 if bf16 else torch.float32)
    seeds = [seed * 31 + g for g in range(len(sizes))]
    kw = dict(rounding="stochastic" if sr else "rtne", pad=True, **knobs)
    fast = kernels.quantize_grouped_values(x.to(DEVICE), fmt, sizes, seeds, backend="triton", **kw)
    assert fast.sizes == tuple(sizes) and (fast.tensor_scales is None) == (fmt == "mxfp4")
    for g, (got, xg) in enumerate(zip(fast.groups(), x.split(sizes))):
        alone = kernels.BlockValues.of(formats.spec_of(fmt).quantize(xg, axis=1, seed=seeds[g], **kw))
        assert_same_values(got, alone)


_COUNTS = st.lists(st.integers(0, 40), min_size=1, max_size=5).filter(sum)


def _kernel_seeds(seeds):
    from fp4lab.kernels.quantize import _kernel_seed
    return torch.tensor([_kernel_seed(s) for s in seeds], dtype=torch.int64, device=DEVICE)


@settings(max_examples=15, deadline=None)
@given(case=st.sampled_from([c for c in GROUPED_CASES if c[1].get("block", (1, 16))[0] == 1]), sizes=_COUNTS,
       length=st.integers(1, 70), seed=st.integers(0, 1000), sr=st.booleans())
def test_device_counts_quantize_as_the_listed_live_groups(case, sizes, length, seed, sr):
    """A routing's counts kept on the device (empty experts included, never read on the host: what
    a CUDA graph can capture) and device seeds give the bytes of the same groups listed on the
    host, the empty ones left out."""
    from fp4lab.kernels.quantize import grouped_block_values
    fmt, knobs = formats.Format(case[0]), dict(case[1])
    x = hard_input((sum(sizes), length), seed, torch.bfloat16).to(DEVICE)
    seeds, live = [seed * 31 + g for g in range(len(sizes))], [g for g, n in enumerate(sizes) if n]
    kw = dict(rounding="stochastic" if sr else "rtne", pad=True, **knobs)
    values, s_dec = grouped_block_values(x, fmt, torch.tensor(sizes, device=DEVICE), _kernel_seeds(seeds), **kw)
    want, want_s = grouped_block_values(x, fmt, [sizes[g] for g in live], [seeds[g] for g in live], **kw)
    assert torch.equal(values.view(torch.int16), want.view(torch.int16))
    assert (s_dec is None) == (want_s is None) and (s_dec is None or torch.equal(s_dec[live], want_s))
    listed_seeds, _ = grouped_block_values(x, fmt, torch.tensor(sizes, device=DEVICE), seeds, **kw)
    assert torch.equal(listed_seeds.view(torch.int16), want.view(torch.int16))  # seeds copied over: the same draws


@pytest.mark.parametrize("wrong,clamped", [([-5, 20, 30], [0, 20, 20]), ([10, 50, 7], [10, 30, 0]),
                                           ([10, -3, 30], [10, 0, 30])])
def test_wrong_device_counts_quantize_as_the_gemm_reads_them(wrong, clamped):
    """Counts never checked on the host that are wrong (negative, past the rows) are read as the
    grouped GEMM reads them, negatives as 0 and the ends stopped at the rows: the clamped counts'
    bytes and the live groups' scales (x has 40 rows; an empty group's S_dec is never written, as
    in any device-count launch). (The starts are groups.edges', whose clamping test_groups holds
    to torch's; this holds the quantize to reading them.)"""
    from fp4lab.kernels.quantize import grouped_block_values
    x = hard_input((40, 48), 7, torch.bfloat16).to(DEVICE)
    seeds = [3, 5, 9]
    got = grouped_block_values(x, formats.Format.NVFP4, torch.tensor(wrong, device=DEVICE), seeds, pad=True)
    want = grouped_block_values(x, formats.Format.NVFP4, torch.tensor(clamped, device=DEVICE), seeds, pad=True)
    live = [g for g, n in enumerate(clamped) if n]
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)) and torch.equal(got[1][live], want[1][live])


@settings(max_examples=15, deadline=None)
@given(fmt=st.sampled_from(["nvfp4", "mxfp4"]), widths=st.lists(st.integers(0, 2), min_size=1, max_size=4).filter(sum),
       cols=st.integers(1, 40), seed=st.integers(0, 1000), sr=st.booleans(),
       hadamard=st.sampled_from([None, "random", "te"]))
def test_device_widths_quantize_columns_as_the_listed_live_groups(fmt, widths, cols, seed, sr, hadamard):
    """wgrad's operands with each expert's padded token count on the device (0 for an expert with
    no tokens) and device seeds: the bytes of the listed live groups."""
    from fp4lab.kernels.quantize import grouped_column_block_values
    if fmt == "mxfp4" and hadamard == "te":
        hadamard = "random"
    widths = [32 * w for w in widths]
    x = hard_input((sum(widths), cols), seed, torch.bfloat16).to(DEVICE)
    seeds, h_seeds = [seed + g for g in range(len(widths))], [seed * 7 + g for g in range(len(widths))]
    live = [g for g, w in enumerate(widths) if w]
    kw = dict(rounding="stochastic" if sr else "rtne", hadamard=hadamard)
    values, s_dec = grouped_column_block_values(x, formats.Format(fmt), torch.tensor(widths, device=DEVICE),
                                                _kernel_seeds(seeds), hadamard_seeds=_kernel_seeds(h_seeds), **kw)
    want, want_s = grouped_column_block_values(x, formats.Format(fmt), [widths[g] for g in live], [seeds[g] for g in live],
                                               hadamard_seeds=[h_seeds[g] for g in live], **kw)
    assert torch.equal(values.view(torch.int16), want.view(torch.int16))
    assert (s_dec is None) == (want_s is None) and (s_dec is None or torch.equal(s_dec[live], want_s))


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(["nvfp4", "mxfp4"]), rows=st.lists(st.integers(0, 70), min_size=1, max_size=4),
       cols=st.integers(1, 40), seed=st.integers(0, 1000), sr=st.booleans(), on_device=st.booleans(),
       hadamard=st.sampled_from([None, "random", "te"]))
@example(fmt="nvfp4", rows=[0, 32, 1], cols=3, seed=1, sr=True, on_device=True, hadamard="random")
@example(fmt="nvfp4", rows=[5, 0, 40, 3], cols=17, seed=2, sr=True, on_device=True, hadamard="random")  # later shifts
@example(fmt="nvfp4", rows=[1, 33, 0, 2], cols=5, seed=3, sr=False, on_device=False, hadamard="te")
def test_unpadded_groups_quantize_as_the_padded_copy(fmt, rows, cols, seed, sr, on_device, hadamard):
    """wgrad's operands read from the routed rows as they are (``rows``), each group's padding
    read as zeros: the bytes of quantizing the zero-padded copy nn made before, at every width,
    with host counts and with device counts (whose layout runs to S + 31 G, rounded up to 32)."""
    if fmt == "mxfp4" and hadamard == "te":
        hadamard = "random"
    # host widths are positive (a group may still have no rows); device widths may be 0
    widths = [max(0 if on_device else 32, -(-n // 32) * 32) for n in rows]
    x = hard_input((sum(rows), cols), seed, torch.bfloat16).to(DEVICE)
    padded_len = -(-(sum(rows) + 31 * len(rows)) // 32) * 32 if on_device else sum(widths)
    padded = torch.zeros(padded_len, cols, dtype=x.dtype, device=DEVICE)
    for xg, start in zip(x.split(rows), [sum(widths[:g]) for g in range(len(rows))]):
        padded[start:start + xg.shape[0]] = xg
    seeds, h_seeds = [seed + g for g in range(len(rows))], [seed * 7 + g for g in range(len(rows))]
    kw = dict(rounding="stochastic" if sr else "rtne", hadamard=hadamard, backend="triton")
    if on_device:
        args = dict(widths=torch.tensor(widths, device=DEVICE), seeds=_kernel_seeds(seeds),
                    hadamard_seeds=_kernel_seeds(h_seeds))
        counts = torch.tensor(rows, device=DEVICE)
    else:
        args, counts = dict(widths=widths, seeds=seeds, hadamard_seeds=h_seeds), rows
    got = kernels.quantize_grouped_columns(x, fmt, rows=counts, **args, **kw)
    want = kernels.quantize_grouped_columns(padded, fmt, **args, **kw)
    assert got.values.shape == want.values.shape == (cols, padded_len)
    assert torch.equal(got.values.view(torch.int16), want.values.view(torch.int16))
    live = [g for g, n in enumerate(rows) if n]  # (an empty group's S_dec is never written, nor read)
    assert (got.tensor_scales is None) == (want.tensor_scales is None)
    assert got.tensor_scales is None or torch.equal(got.tensor_scales[live], want.tensor_scales[live])
    if not on_device:  # the reference pads each group itself (the same values as the kernels, zeros' signs aside)
        reference = kernels.quantize_grouped_columns(x.cpu(), fmt, rows=rows, **args, **{**kw, "backend": "reference"})
        assert_same_values(kernels.BlockValues(got.values, None, cols, got.format),
                           kernels.BlockValues(reference.values, None, cols, reference.format))
        assert (reference.tensor_scales is None) == (got.tensor_scales is None)
        assert got.tensor_scales is None or torch.equal(got.tensor_scales.cpu(), reference.tensor_scales)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_unpadded_groups_that_do_not_fit_their_widths_are_refused(backend):
    """On both backends (the reference would pad by a negative amount, or zip groups away)."""
    x = torch.randn(40, 8, device=DEVICE if backend == "triton" else "cpu")

    def call(widths, rows):
        return kernels.quantize_grouped_columns(x, "nvfp4", widths, [1] * len(widths), rows=rows, backend=backend)
    with pytest.raises(ValueError, match="must each lie in"):
        call([32, 32], [35, 5])
    with pytest.raises(ValueError, match="must each lie in"):
        call([32, 32], [45, -5])
    with pytest.raises(ValueError, match="rows sum to 30, x has 40"):
        call([32, 32], [20, 10])
    with pytest.raises(ValueError, match="2 rows for 1 widths"):
        call([32], [20, 20])
    with pytest.raises(ValueError, match="must both be device tensors or both host ints"):
        call(torch.tensor([32, 32], device=x.device), [20, 20])
    with pytest.raises(ValueError, match="must both be device tensors or both host ints"):
        call([32, 32], torch.tensor([20, 20], device=x.device))


def test_device_counts_are_refused_in_a_form_that_cannot_be_right():
    from fp4lab.kernels.quantize import grouped_block_values, grouped_column_block_values
    x, nv = torch.randn(32, 32, device=DEVICE), formats.Format.NVFP4
    for counts in (torch.tensor([16.0, 16.0], device=DEVICE), torch.tensor([32], device=DEVICE)):
        with pytest.raises(ValueError, match="sizes as a tensor must be 2 int32/int64 counts"):
            grouped_block_values(x, nv, counts, [1, 2])
        with pytest.raises(ValueError, match="widths as a tensor must be 2 int32/int64 counts"):
            grouped_column_block_values(x, nv, counts, [1, 2])
    with pytest.raises(ValueError, match="1 x n blocks"):  # 16x16 tiles need their groups' sizes checked
        grouped_block_values(x, nv, torch.tensor([16, 16], device=DEVICE), [1, 2], block=(16, 16))
    with pytest.raises(ValueError, match="int64 kernel seeds"):
        grouped_block_values(x, nv, torch.tensor([16, 16], device=DEVICE), torch.tensor([1, 2], dtype=torch.int32),
                             rounding="stochastic")


@pytest.mark.parametrize("sizes", [[7, 1, 50, 32], [0, 70, 0, 20], [90], [45, 45, 0]])
def test_grouped_amax_is_each_groups_amax(sizes):
    """Tiles of 32 rows (GROUPED_TILE) that straddle groups, lie inside one (one atomic for the
    tile), end past the last row, and empty groups (amax 0)."""
    from fp4lab.kernels.amax import GROUPED_TILE, grouped_finite_amax
    assert GROUPED_TILE[0] == 32  # the cases above are laid out for it
    x = hard_input((90, 48), 3)
    starts = torch.tensor([0, *itertools.accumulate(sizes)][:-1], device=DEVICE)
    got = grouped_finite_amax(x.to(DEVICE), starts).cpu()
    want = [formats.blocks.finite_amax(xg) if xg.numel() else torch.zeros(()) for xg in x.split(sizes)]
    assert torch.equal(got, torch.stack(want))


def test_grouped_quantize_refuses_groups_that_do_not_fit():
    x = torch.randn(40, 32, device=DEVICE)
    for sizes, seeds, block in [([20, 10], [1, 2], 16), ([20, 20], [1], 16), ([20, 0, 20], [1, 2, 3], 16),
                                ([24, 16], [1, 2], (16, 16))]:
        with pytest.raises(ValueError, match="does not split into groups"):
            kernels.quantize_grouped_values(x, "nvfp4", sizes, seeds, backend="triton", block=block, pad=True)


def test_grouped_values_gemm_equals_the_listed_operands(monkeypatch):
    """grouped_values_mm on GroupedValues (no copy to join them, one alpha multiply) gives the bits
    it gives on the same operands as lists of BlockValues."""
    torch.manual_seed(0)
    sizes, x, w = [5, 19, 8], torch.randn(32, 64, device=DEVICE), torch.randn(3 * 16, 64, device=DEVICE)
    a = kernels.quantize_grouped_values(x, "nvfp4", sizes, [1, 2, 3], backend="triton", pad=True)
    b = kernels.quantize_grouped_values(w, "nvfp4", [16] * 3, [4, 5, 6], backend="triton", pad=True,
                                        block=(16, 16))
    joined = kernels.grouped_values_mm(a, b, backend="triton")
    listed = kernels.grouped_values_mm(a.groups(), b.groups(), backend="triton")
    assert torch.equal(joined, listed)
    assert torch.equal(kernels.grouped_values_mm(a.groups(), b, backend="triton"), listed)  # b a stack view
    # dgrad's operand: every expert's 16x16 tiles read along the other axis, one copy, the bits of
    # each expert's BlockValues.transposed
    dy = torch.randn(32, 16, device=DEVICE)
    a_dgrad = kernels.quantize_grouped_values(dy, "nvfp4", sizes, [7, 8, 9], backend="triton", pad=True)
    w_t = b.transposed(64)
    assert w_t.sizes == (64,) * 3 and w_t.values.shape == (3 * 64, 16)
    for got, alone in zip(w_t.groups(), b.groups()):
        assert torch.equal(got.matrix, alone.transposed(64).matrix) and torch.equal(got.tensor_scale, alone.tensor_scale)
    assert torch.equal(kernels.grouped_values_mm(a_dgrad, w_t, backend="triton"),
                       kernels.grouped_values_mm(a_dgrad.groups(), [v.transposed(64) for v in b.groups()],
                                                 backend="triton"))
    with pytest.raises(ValueError, match="do not pair"):
        kernels.grouped_values_mm(a, w_t, backend="triton")  # K 64 against 16
    # read in place (TransposedGroups: no copy; N-major through TMA on a GPU where K is whole tiles):
    # the copy's bits, with host and with device sizes
    w64 = kernels.quantize_grouped_values(torch.randn(3 * 64, 64, device=DEVICE), "nvfp4", [64] * 3, [4, 5, 6],
                                          backend="triton", pad=True, block=(16, 16))
    dy64 = kernels.quantize_grouped_values(torch.randn(32, 64, device=DEVICE), "nvfp4", sizes, [7, 8, 9],
                                           backend="triton", pad=True)
    on_device = kernels.quantize_grouped_values(torch.randn(32, 64, device=DEVICE), "nvfp4",
                                                torch.tensor(sizes, device=DEVICE), [7, 8, 9], backend="triton")
    from fp4lab.kernels import matmul
    read, real = [], matmul.grouped_scaled_mm
    monkeypatch.setattr(matmul, "grouped_scaled_mm", lambda a_, b_, *x, **kw: read.append(b_) or real(a_, b_, *x, **kw))
    for ops, w_ in ((a_dgrad, b), (dy64, w64), (on_device, w64)):
        rows = w_.values.shape[1]
        in_place = kernels.grouped_values_mm(ops, kernels.TransposedGroups(w_, rows), backend="triton")
        assert read[-1].data_ptr() == w_.values.data_ptr() and read[-1].stride(1) == 1  # (the weights' memory)
        assert torch.equal(in_place.view(torch.int32), kernels.grouped_values_mm(ops, w_.transposed(rows),
                                                                                 backend="triton").view(torch.int32))
    with pytest.raises(ValueError, match="do not pair"):
        kernels.grouped_values_mm(a, kernels.TransposedGroups(b, 64), backend="triton")
    # K not a multiple of 16: the tiles' padding columns are not rows of the transposed groups
    w40 = kernels.quantize_grouped_values(w[:, :40], "nvfp4", [16] * 3, [4, 5, 6], backend="triton", pad=True,
                                          block=(16, 16))
    assert w40.values.shape == (48, 48) and w40.transposed(40).values.shape == (3 * 40, 16)
    for got, alone in zip(w40.transposed(40).groups(), w40.groups()):
        assert torch.equal(got.matrix, alone.transposed(40).matrix)
    with pytest.raises(ValueError, match="row groups of one size"):
        a.transposed(64)
    reference = kernels.grouped_values_mm(a, b, backend="reference")
    torch.testing.assert_close(joined.cpu(), reference.cpu(), rtol=1e-5, atol=1e-5)  # fp32 summation order


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(["nvfp4", "nvfp4-46", "mxfp4"]), widths=st.lists(st.integers(1, 3), min_size=1, max_size=4),
       cols=st.integers(1, 40), seed=st.integers(0, 1000), sr=st.booleans(), bf16=st.booleans(),
       hadamard=st.sampled_from([None, "none", "random", "te"]))
def test_grouped_columns_quantize_is_each_group_quantized_alone(fmt, widths, cols, seed, sr, bf16, hadamard):
    """wgrad's operands of every expert (tokens padded per expert to a multiple of 32, quantized
    along the tokens, rotated as asked) in one launch: each group's columns are the bytes of
    quantizing it alone, with its own seed and random signs, Philox counted in its own layout."""
    if fmt == "mxfp4" and hadamard == "te":
        hadamard = "random"  # TE's signs are 16-point
    widths = [32 * w for w in widths]
    x = hard_input((sum(widths), cols), seed, torch.bfloat16 if bf16 else torch.float32)
    seeds, h_seeds = [seed + g for g in range(len(widths))], [seed * 7 + g for g in range(len(widths))]
    knobs = {"nvfp4": {}, "nvfp4-46": dict(profile="four_over_six"), "mxfp4": dict(mode="even")}[fmt]
    fmt = fmt.split("-")[0]
    kw = dict(rounding="stochastic" if sr else "rtne", **knobs)
    fast = kernels.quantize_grouped_columns(x.to(DEVICE), fmt, widths, seeds, hadamard=hadamard, hadamard_seeds=h_seeds,
                                            backend="triton", **kw)
    rotation = {} if hadamard is None else dict(hadamard=hadamard)
    assert fast.axis == 1 and fast.sizes == tuple(widths) and fast.values.shape == (cols, sum(widths))
    reference = kernels.quantize_grouped_columns(x, fmt, widths, seeds, hadamard=hadamard, hadamard_seeds=h_seeds,
                                                 backend="reference", **kw)
    assert_same_values(kernels.BlockValues(fast.values, None, cols, fast.format),
                       kernels.BlockValues(reference.values, None, cols, reference.format))
    for g, (got, xg) in enumerate(zip(fast.groups(), x.split(widths))):
        alone = formats.spec_of(fmt).quantize(xg, axis=0, seed=seeds[g], hadamard_seed=h_seeds[g], **rotation, **kw)
        assert_same_values(got, kernels.BlockValues.of(alone))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_contraction_grouped_gemm_is_each_wgrad_alone(fmt, monkeypatch):
    """Every expert's wgrad in one launch, read in place from quantize_grouped_columns' buffer:
    each expert's dW is values_mm of its own operands, bit for bit (the pointer kernel on both
    sides: the same summation); a copy where the groups are not one buffer's columns gives the same."""
    from fp4lab.kernels import matmul
    monkeypatch.setattr(matmul, "USE_TMA", False)
    monkeypatch.setattr(matmul, "CUBLASLT", False)
    torch.manual_seed(1)
    widths = [32, 96, 64]
    dy, x = torch.randn(sum(widths), 48, device=DEVICE), torch.randn(sum(widths), 80, device=DEVICE)
    grouped_a = kernels.quantize_grouped_columns(dy, fmt, widths, [1, 2, 3], backend="triton")
    grouped_b = kernels.quantize_grouped_columns(x, fmt, widths, [4, 5, 6], backend="triton", rounding="stochastic")
    got = kernels.contraction_grouped_values_mm(grouped_a, grouped_b, backend="triton")  # taken whole
    assert got.shape == (3, 48, 80)
    a, b = grouped_a.groups(), grouped_b.groups()
    assert torch.equal(kernels.contraction_grouped_values_mm(a, b, backend="triton"), got)  # listed
    assert kernels._joined_columns(a).data_ptr() == a[0].values.data_ptr()  # read in place, no copy
    for g, (va, vb) in enumerate(zip(a, b)):
        assert torch.equal(got[g], kernels.values_mm(va, vb, backend="triton"))
    copied = [kernels.BlockValues(v.values.clone(), v.tensor_scale, v.rows, v.format) for v in a]
    assert torch.equal(kernels.contraction_grouped_values_mm(copied, b, backend="triton"), got)
    reference = kernels.contraction_grouped_values_mm(grouped_a, grouped_b, backend="reference")
    torch.testing.assert_close(got.cpu(), reference.cpu(), rtol=1e-5, atol=1e-5)  # fp32 summation order
    with pytest.raises(ValueError, match="same rows"):
        kernels.contraction_grouped_values_mm(a[:1] + copied[1:2], [b[0], kernels.BlockValues(
            b[1].values[:40], b[1].tensor_scale, 40, b[1].format)], backend="triton")


def test_grouped_columns_refuse_widths_that_straddle_tiles():
    x = torch.randn(64, 16, device=DEVICE)
    for widths, seeds in [([48, 16], [1, 2]), ([64], [1, 2]), ([32, 0, 32], [1, 2, 3])]:
        with pytest.raises(ValueError, match="does not split into groups"):
            kernels.quantize_grouped_columns(x, "nvfp4", widths, seeds, backend="triton")


@settings(max_examples=12, deadline=None)
@given(fmt=st.sampled_from(["nvfp4", "mxfp4"]), axis=st.sampled_from([0, 1]), seed=st.integers(0, 2**63 - 1),
       h_seed=st.integers(0, 2**63 - 1), sr=st.booleans(), rotate=st.booleans())
@example(fmt="nvfp4", axis=0, seed=5, h_seed=2**62 + 7, sr=True, rotate=True)
@example(fmt="mxfp4", axis=1, seed=2**40, h_seed=3, sr=True, rotate=True)
def test_a_device_seed_gives_the_bytes_of_its_int(fmt, axis, seed, h_seed, sr, rotate):
    """Seeds given as one-element int64 tensors (what a captured CUDA graph reads at each replay:
    nn.seeds) are read by the kernel from memory, with the bytes the same ints give as arguments,
    on both backends; the SR seed and the Hadamard seed each on its own."""
    x = hard_input((64, 96), seed % 1000, torch.bfloat16).to(DEVICE)
    kw = dict(axis=axis, rounding="stochastic" if sr else "rtne", pad=True,
              **(dict(hadamard="random") if rotate else {}))
    as_ints = kernels.quantize_values(x, fmt, seed=seed, hadamard_seed=h_seed, backend="triton", **kw)
    for s, h in ((torch.tensor([seed], device=DEVICE), torch.tensor([h_seed], device=DEVICE)),
                 (seed, torch.tensor([h_seed], device=DEVICE)), (torch.tensor([seed], device=DEVICE), h_seed)):
        assert_same_values(kernels.quantize_values(x, fmt, seed=s, hadamard_seed=h, backend="triton", **kw), as_ints)
    reference = kernels.quantize_values(x.cpu(), fmt, seed=torch.tensor([seed]), hadamard_seed=torch.tensor([h_seed]),
                                        backend="reference", **kw)
    assert_same_values(as_ints, reference)
    with pytest.raises(ValueError, match="one int64 element"):
        kernels.quantize_values(x, fmt, seed=torch.tensor([seed, seed], device=DEVICE), rounding="stochastic",
                                backend="triton")


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(["nvfp4", "mxfp4"]), rules=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       m=st.integers(1, 70), k_blocks=st.integers(1, 5), seed=st.integers(0, 1000),
       sr=st.tuples(st.booleans(), st.booleans()), bf16=st.booleans(),
       hadamard=st.sampled_from([None, "none", "random", "te"]), device_seeds=st.booleans())
@example(fmt="nvfp4", rules=(0, 0), m=64, k_blocks=4, seed=3, sr=(True, True), bf16=True, hadamard="random",
         device_seeds=True)
@example(fmt="nvfp4", rules=(1, 0), m=40, k_blocks=2, seed=4, sr=(False, True), bf16=True, hadamard="random",
         device_seeds=False)  # the nvfp4_torchao recipe: fprop's x torchao, wgrad's te
@example(fmt="mxfp4", rules=(0, 3), m=70, k_blocks=3, seed=5, sr=(True, False), bf16=False, hadamard="none",
         device_seeds=False)  # more rows than one tile
def test_a_pair_is_both_copies_quantized_alone(fmt, rules, m, k_blocks, seed, sr, bf16, hadamard, device_seeds):
    """A linear's two copies of one tensor from one read (x for fprop and wgrad, dy for dgrad and
    wgrad): the rows copy is x quantized along K, the columns copy x zero-padded to a multiple of
    32 rows, rotated as asked and quantized along the rows, each with its own scale rule, rounding
    and seed: the bytes, tensor scales and rows of the two calls alone (the reference's)."""
    choices = ([dict(block=(1, 16), profile=p) for p in ("te", "torchao", "four_over_six", "te")] if fmt == "nvfp4"
               else [dict(mode=mode) for mode in ("floor", "ceil", "even", "rceil")])
    if fmt == "mxfp4" and hadamard == "te":
        hadamard = "random"  # TE's signs are 16-point
    block = 16 if fmt == "nvfp4" else 32
    x = hard_input((m, k_blocks * block), seed, torch.bfloat16 if bf16 else torch.float32)
    seeds = (seed + 1, seed + 2, seed + 3)
    as_seed = (lambda s: torch.tensor([s], device=DEVICE)) if device_seeds else (lambda s: s)
    rows = dict(rounding="stochastic" if sr[0] else "rtne", seed=as_seed(seeds[0]), **choices[rules[0]])
    columns = dict(rounding="stochastic" if sr[1] else "rtne", seed=as_seed(seeds[1]), **choices[rules[1]],
                   **({} if hadamard is None else dict(hadamard=hadamard, hadamard_seed=as_seed(seeds[2]))))
    padded = m + (-m % 32)
    from fp4lab.kernels.quantize import block_values_pair  # the pair kernel itself, not a fallback
    fast = block_values_pair(x.to(DEVICE), formats.Format.parse(fmt), rows=rows, columns=columns, columns_len=padded)
    plain = lambda kw: {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    alone = (kernels.quantize_values(x, fmt, axis=1, pad=True, backend="reference", **plain(rows)),
             kernels.quantize_values(torch.nn.functional.pad(x, (0, 0, 0, padded - m)), fmt, axis=0, pad=True,
                                     backend="reference", **plain(columns)))
    for got, want in zip(fast, alone):
        assert_same_values(got, want)


def test_a_pair_the_kernel_does_not_cover_is_the_two_calls():
    """fp16, K not a multiple of the block, 16x16 blocks: quantize_values_pair makes the copies
    one by one (the same function), and the pair kernel refuses them with the reason; a padded
    length that is no whole number of blocks, or shorter than x, is an error on both backends."""
    from fp4lab.kernels.quantize import block_values_pair
    x = hard_input((40, 48), 2)
    for length in (40, 32):  # not whole blocks, fewer rows than x: refused on every backend
        for backend in ("triton", "reference"):
            with pytest.raises(ValueError, match="columns_len"):
                kernels.quantize_values_pair(x, "nvfp4", rows={}, columns={}, columns_len=length, backend=backend)
    for t, rows, length in ((x.half().nan_to_num(0.0, 6e4, -6e4), {}, 64), (x[:, :40], {}, 64),
                            (x, dict(block=(16, 16)), 48)):
        got = kernels.quantize_values_pair(t.to(DEVICE), "nvfp4", rows=rows, columns={}, columns_len=length,
                                           backend="triton")
        padded = torch.nn.functional.pad(t, (0, 0, 0, length - t.shape[0]))
        assert_same_values(got[0], kernels.quantize_values(t, "nvfp4", axis=1, pad=True, backend="reference", **rows))
        assert_same_values(got[1], kernels.quantize_values(padded, "nvfp4", axis=0, pad=True, backend="reference"))
        with pytest.raises(ValueError, match="block_values_pair"):
            block_values_pair(t.to(DEVICE), formats.Format.NVFP4, rows=rows, columns={}, columns_len=length)


@settings(max_examples=12, deadline=None)
@given(scale=st.sampled_from([1.0, 3e-38, 1e-45, 7.3e-3, 3.4e38, 0.0]), mag=st.sampled_from([1.0, 1e-30, 6e4]),
       which=st.sampled_from([(True, False), (False, True), (True, True)]), seed=st.integers(0, 2**16))
@example(scale=1e-45, mag=6e4, which=(True, True), seed=0)  # S_dec * partner below fp32's normals
def test_a_pair_writes_each_copys_alpha_against_its_partner(scale, mag, which, seed):
    """With a partner tensor scale for a copy, the pair kernel writes S_dec * partner (one fp32
    multiply: torch.mul's bits), and the copies' bytes and S_dec stay the same."""
    x = (hard_input((40, 64), seed, torch.bfloat16).float() * mag).bfloat16().to(DEVICE)
    kw = dict(rows=dict(rounding="stochastic", seed=seed), columns=dict(hadamard="te"), columns_len=64)
    partners = [torch.tensor(scale * (1 + i), device=DEVICE) if used else None for i, used in enumerate(which)]
    plain = kernels.quantize_values_pair(x, "nvfp4", backend="triton", **kw)
    got = kernels.quantize_values_pair(x, "nvfp4", backend="triton", partners=tuple(partners), **kw)
    for g, p, partner in zip(got, plain, partners):
        assert torch.equal(g.values.view(torch.int16), p.values.view(torch.int16))
        assert torch.equal(g.tensor_scale.view(torch.int32), p.tensor_scale.view(torch.int32))
        if partner is None:
            assert g.alpha_with is None
        else:
            assert g.alpha_with[0] is g.tensor_scale and g.alpha_with[1] is partner
            assert torch.equal(g.alpha_with[2].view(torch.int32), torch.mul(p.tensor_scale, partner).view(torch.int32))


def test_a_pairs_alpha_reaches_the_gemm_only_against_its_partner(monkeypatch):
    """values_mm passes a copy's written alpha to the GEMM where the other operand's tensor scale is
    the partner it was written for and its own is the one it was written with, else both scales (a
    partner of the same value is not enough);
    MXFP4 (no tensor scale) and a malformed partner write none."""
    from fp4lab.kernels import matmul
    x = hard_input((32, 64), 3, torch.bfloat16).to(DEVICE)
    w = kernels.quantize_values(hard_input((48, 64), 4, torch.bfloat16).to(DEVICE), "nvfp4", axis=1,
                                backend="triton")
    rows, _ = kernels.quantize_values_pair(x, "nvfp4", rows={}, columns={}, columns_len=32,
                                           partners=(w.tensor_scale, None), backend="triton")
    seen, real = [], matmul.scaled_mm
    monkeypatch.setattr(matmul, "scaled_mm", lambda a, b, alpha, **kw: seen.append(alpha) or real(a, b, alpha, **kw))
    out = kernels.values_mm(rows, w, backend="triton")
    other = w._replace(tensor_scale=w.tensor_scale.clone())
    again = kernels.values_mm(rows, other, backend="triton")
    rescaled = kernels.values_mm(rows._replace(tensor_scale=rows.tensor_scale * 2), w, backend="triton")
    assert seen[0] is rows.alpha_with[2] and isinstance(seen[1], tuple) and isinstance(seen[2], tuple)
    assert torch.equal(out.view(torch.int32), again.view(torch.int32))  # (the same bits either way)
    assert torch.equal(rescaled.view(torch.int32), (2 * out).view(torch.int32))  # (its own scale changed: x2 exact)
    mx = kernels.quantize_values_pair(x, "mxfp4", rows={}, columns={}, columns_len=32,
                                      partners=(w.tensor_scale, w.tensor_scale), backend="triton")
    assert mx[0].alpha_with is None and mx[1].alpha_with is None
    with pytest.raises(ValueError, match="partner"):
        kernels.quantize_values_pair(x, "nvfp4", rows={}, columns={}, columns_len=32,
                                     partners=(w.tensor_scale.double(), None), backend="triton")


@pytest.mark.parametrize("tile", [(32, 32, 2), (64, 32, 4), (32, 64, 4), (128, 64, 8)])
def test_a_pairs_bytes_do_not_depend_on_its_tile(tile, monkeypatch):
    """The tiles benchmarks/sweep_quantize.py tries for the pair kernel give the same bytes (each
    copy's blocks, amaxes and Philox groups are the tile's, wherever its edges fall)."""
    from fp4lab.kernels import quantize as triton_quantize
    x = hard_input((72, 96), 5, torch.bfloat16)
    kw = dict(rows=dict(rounding="stochastic", seed=4),
              columns=dict(rounding="stochastic", seed=5, hadamard="random", hadamard_seed=6), columns_len=96)
    monkeypatch.setattr(triton_quantize, "PAIR_TILE", tile)
    got = kernels.quantize_values_pair(x.to(DEVICE), "nvfp4", backend="triton", **kw)
    want = kernels.quantize_values_pair(x, "nvfp4", backend="reference", **kw)
    for g, w in zip(got, want):
        assert_same_values(g, w)


@pytest.mark.parametrize("dtype,hadamard,programs", [(torch.bfloat16, "random", 1), (torch.float32, "te", 1),
                                                    (torch.bfloat16, "none", 3), (torch.float32, None, 1)])
def test_a_pair_gives_the_same_bytes_however_many_tiles_a_program_takes(dtype, hadamard, programs, monkeypatch):
    """Both pair passes take several tiles down the rows a program (the last program's past the
    padded rows: masked); the amax pass keeps elementwise maxima and applies the rotation's 1/4
    and bf16 rounding once, to the max. The tensor scales and bytes are the reference's (NaN,
    Inf, zeros and subnormals in x; the largest rotated value in any of a program's tiles)."""
    from fp4lab.kernels import quantize as triton_quantize
    monkeypatch.setattr(triton_quantize, "PAIR_TILE", (32, 32, 2))
    monkeypatch.setattr(triton_quantize, "PAIR_ITERS", (8, 4))
    monkeypatch.setattr(triton_quantize, "PAIR_PROGRAMS", programs)
    monkeypatch.setattr(triton_quantize, "_PAIR_PLANS", PlanTable(8))  # this test's plans alone
    x = hard_input((150, 64), 8, dtype)
    x[77, 5] = 3.0e38  # a rotated run that overflows fp32 (left out) ...
    x[78, 5] = 2.9e38  # ... beside finite ones in the same column
    x[131, 40] = -3.3e38  # the largest finite value (both amaxes), in a program's last tiles
    rot = {} if hadamard is None else dict(hadamard=hadamard, hadamard_seed=6)
    kw = dict(rows=dict(rounding="stochastic", seed=4), columns=dict(rounding="stochastic", seed=5, **rot),
              columns_len=160)
    got = kernels.quantize_values_pair(x.to(DEVICE), "nvfp4", backend="triton", **kw)
    plans = list(triton_quantize._PAIR_PLANS.values())
    assert plans and all(p.iters == ((8, 4) if programs == 1 else (4, 4)) for p in plans)  # the loops ran
    want = kernels.quantize_values_pair(x, "nvfp4", backend="reference", **kw)
    for g, w in zip(got, want):
        assert_same_values(g, w)


def test_the_moe_quantize_benchmark_times_the_calls_a_graphed_moe_step_makes(monkeypatch):
    """benchmarks/bench_moe_quantizes.py's cases, at small sizes: each runs on the Triton path,
    the grouped ones with the counts kept on the device (what a graphed step launches; their
    bytes are the grouped quantize tests' business)."""
    import importlib
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    bench = importlib.import_module("benchmarks.bench_moe_quantizes")
    monkeypatch.setenv("FP4LAB_BACKEND", "triton")
    counts = bench.routed_counts(96, 4, 2)
    assert int(counts.sum()) == 192 and counts.numel() == 4
    timed = bench.cases(counts, 32, 48, 64, dev=DEVICE)
    assert len(timed) == 15  # 4 grouped copies and 3 controls at each of two widths, and the dense pair
    for name, (fn, nbytes) in timed.items():
        got = fn()
        assert nbytes > 0, name
        if isinstance(got, kernels.GroupedValues):  # device sizes kept as they are: never read
            assert isinstance(got.sizes, torch.Tensor), name


def test_the_moe_quantize_benchmark_tries_tiles_that_give_the_same_bytes(monkeypatch):
    """bench_moe_quantizes.py --tiles: every case's tiles are ones its launches accept (a grouped
    columns launch fixes the width at 32), each gives the default tile's bytes (a tile is a
    schedule, never a result), and the setting is restored after each."""
    import importlib
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    bench = importlib.import_module("benchmarks.bench_moe_quantizes")
    from fp4lab.kernels import quantize
    monkeypatch.setenv("FP4LAB_BACKEND", "triton")
    before = (dict(quantize.TILES), quantize.PAIR_TILE)
    timed = bench.cases(bench.routed_counts(48, 4, 2), 32, 32, 32, dev=DEVICE)

    def flat(got):  # BlockValues, GroupedValues, or a pair of BlockValues
        parts = got if isinstance(got, tuple) and not hasattr(got, "values") else (got,)  # (BlockValues is one)
        return [t for p in parts for t in (p.values, getattr(p, "tensor_scale", getattr(p, "tensor_scales", None)))]
    for name, (fn, _) in timed.items():
        path, tiles = bench.tile_choices(name)
        if path == "amax":  # the amax controls launch no quantize kernel
            assert name.startswith("control:"), name
            continue
        assert tiles and (path != "transposed" or all(t[1] == quantize.COL_GROUP_WIDTH for t in tiles)), name
        want = flat(fn())
        for tile in tiles:
            got = flat(bench.with_tile(path, tile, fn))
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), (name, tile)
        assert (dict(quantize.TILES), quantize.PAIR_TILE) == before
