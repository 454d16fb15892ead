"""The FP4 linear: BF16 equals nn.Linear, each GEMM's operands equal fp4lab.formats by hand."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from fp4lab.formats import Format
from fp4lab import formats
from fp4lab.kernels import BlockValues
from fp4lab.nn import gemms as G
from fp4lab.nn import linear as L
from fp4lab.nn.gemms import make_call
from fp4lab.nn.linear import FP4Linear, QuantContext, fp4_linear
from fp4lab.nn.quant import derive_seed, derive_seeds, rotation_for
from fp4lab.nn.recipe import (GEMMS, PRESETS, GemmSpec, HadamardMode, Operand, Recipe, bf16,
                              nvfp4, preset)


def _grads(layer, x, dy):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y, x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_recipe_equals_nn_linear_exactly(autocast):
    torch.manual_seed(0)
    ref = nn.Linear(96, 64)
    fp4 = FP4Linear.from_linear(nn.Linear(96, 64), bf16(), name="l", context=QuantContext())
    fp4.load_state_dict(ref.state_dict())
    x, dy = torch.randn(3, 7, 96), torch.randn(3, 7, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, want = _grads(fp4, x, dy.bfloat16() if autocast else dy), _grads(ref, x, dy.bfloat16() if autocast else dy)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


class _Recorder:
    """Wraps quant.quantize_operand inside nn.gemms, and Call.operand_pair (two copies of one
    tensor from one read): (gemm, side) -> (source, axis, result); a pair's columns copy is
    recorded with its source as wgrad sees it, zero-padded to a multiple of 32 rows."""

    def __init__(self, monkeypatch):
        self.seen = {}
        self.pairs = []
        real, real_pair = G.quantize_operand, G.Call.operand_pair

        def spy(t, axis, op, *, seed, rotation=None, stats=None, key="", **kwargs):
            out = real(t, axis, op, seed=seed, rotation=rotation, stats=stats, key=key, **kwargs)
            gemm, side = key.split(".")[-2:]
            self.seen[gemm, side] = (t, axis, out)
            return out

        def spy_pair(call, t, rows, columns, partners=(None, None)):
            out = real_pair(call, t, rows, columns, partners)
            if out is not None:
                self.pairs.append((rows, columns))
                self.seen[rows] = (t, 1, out[0])
                self.seen[columns] = (torch.nn.functional.pad(t, (0, 0, 0, -t.shape[0] % 32)), 0, out[1])
            return out
        monkeypatch.setattr(G, "quantize_operand", spy)
        monkeypatch.setattr(G.Call, "operand_pair", spy_pair)


def _by_hand(t, axis, op: Operand, spec: GemmSpec, recipe: Recipe, root: int, gemm: str, side: str):
    """The operand from fp4lab.formats alone, following the documented seeding rule."""
    rot = rotation_for(spec, recipe.seed, derive_seed(root, GEMMS.index(gemm), ord("h")))
    if rot is not None:
        t = formats.hadamard_transform(t, axis=axis, size=rot.size, signs=rot.signs, seed=rot.seed)
    if not op.quantized:
        return t
    seed = derive_seed(root, GEMMS.index(gemm), ord(side))
    if op.format is Format.NVFP4:
        return formats.quantize_nvfp4(t, axis=axis, block=(16, 16) if op.block2d else 16, rounding=op.rounding,
                                      seed=seed, profile=op.profile, pad=True)
    return formats.quantize_mxfp4(t, axis=axis, mode=op.mx_mode, rounding=op.rounding, seed=seed, pad=True)


def _same(a, b):
    """a: an operand as the layer made it (a tensor, FP4Tensor or BlockValues), b: by hand."""
    if isinstance(a, BlockValues):
        want = b if isinstance(b, BlockValues) else BlockValues.of(b)
        got, ref = a.matrix.cpu().float(), want.matrix.cpu().float()  # NaN blocks compare as NaN
        assert a.rows == want.rows and torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(got.nan_to_num(0.5), ref.nan_to_num(0.5))
        assert (a.tensor_scale is None and want.tensor_scale is None) or \
            torch.equal(a.tensor_scale.cpu(), want.tensor_scale.cpu())
        return
    a = a.to("cpu")
    if isinstance(b, torch.Tensor):
        assert torch.equal(a, b)
        return
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert (a.tensor_scale is None and b.tensor_scale is None) or torch.equal(a.tensor_scale, b.tensor_scale)
    assert (a.axis, a.block, a.format, a.rounding) == (b.axis, b.block, b.format, b.rounding)


_VARIANTS = {  # recipes the studies run that no preset names
    "nvfp4_random_signs": lambda: nvfp4().override({"wgrad.hadamard": "random"}),
    "nvfp4_torchao": lambda: nvfp4().override({"fprop.a.profile": "torchao"}),
    # gap-closers' fprop_hadamard: fprop's weight is rotated, so dgrad cannot reuse its 16x16 tiles
    "nvfp4_fprop_hadamard": lambda: nvfp4().override({"fprop.hadamard": "deterministic"}),
    "four_over_six_w1x16_fprop_hadamard": lambda: preset("nvfp4_four_over_six").override(
        {"fprop.b.block2d": False, "dgrad.b.block2d": False, "fprop.hadamard": "deterministic"}),
}


@pytest.mark.parametrize("name", [*PRESETS, *_VARIANTS])
def test_every_gemm_operand_equals_formats_by_hand(name, monkeypatch):
    recipe = _VARIANTS.get(name, lambda: preset(name))()
    rec = _Recorder(monkeypatch)
    torch.manual_seed(1)
    m, k, n = 40, 64, 96  # 40 tokens: the wgrad token axis is zero-padded to 64
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k) * 0.05).requires_grad_()
    dy = torch.randn(m, n, dtype=torch.bfloat16) * 1e-3
    ctx = QuantContext(tick=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp4_linear(x, w, None, recipe, name="blocks.0.mlp", context=ctx).backward(dy)
    root = derive_seed(recipe.seed, L.layer_key("blocks.0.mlp"), 5)
    w16 = w.detach().bfloat16()
    pad = torch.zeros(24, 1, dtype=torch.bfloat16)
    sources = {("fprop", "a"): (x.detach(), 1), ("fprop", "b"): (w16, 1), ("dgrad", "a"): (dy, 1),
               ("dgrad", "b"): (w16, 0), ("wgrad", "a"): (torch.cat([dy, pad.expand(24, n)]), 0),
               ("wgrad", "b"): (torch.cat([x.detach(), pad.expand(24, k)]), 0)}
    expected = {key for key in sources if recipe.gemm(key[0]).quantized or recipe.gemm(key[0]).rotated}
    reused = make_call(recipe, "blocks.0.mlp", ctx).dgrad_reuses_fprop_weight()
    assert set(rec.seen) == expected - ({("dgrad", "b")} if reused else set())
    for (gemm, side), (t, axis) in sources.items():
        if (gemm, side) in expected:
            spec = recipe.gemm(gemm)
            want = _by_hand(t, axis, getattr(spec, side), spec, recipe, root, gemm, side)
            if (gemm, side) == ("dgrad", "b") and reused:  # fprop's 16x16 weight values, transposed
                _same(rec.seen["fprop", "b"][2].transposed(k), want)
                continue
            assert torch.equal(rec.seen[gemm, side][0], t) and rec.seen[gemm, side][1] == axis
            _same(rec.seen[gemm, side][2], want)


def test_2d_weight_tiles_give_dgrad_the_same_weight_as_fprop(monkeypatch):
    rec = _Recorder(monkeypatch)
    x, w = torch.randn(32, 64, requires_grad=True), (torch.randn(48, 64) * 0.1).requires_grad_()
    fp4_linear(x, w, None, nvfp4(), name="l").sum().backward()
    assert ("dgrad", "b") not in rec.seen  # dgrad multiplies fprop's weight values transposed
    fwd = rec.seen["fprop", "b"][2]
    _same(fwd.transposed(64), formats.quantize_nvfp4(w.detach(), axis=0, block=(16, 16), pad=True))


@pytest.mark.parametrize("mode", ["deterministic", "random"])
def test_hadamard_cancels_in_fprop_and_leaves_dgrad_alone(mode, monkeypatch):
    rec = _Recorder(monkeypatch)
    rotated = Recipe(fprop=GemmSpec(hadamard=mode))
    x, w, dy = torch.randn(64, 32), torch.randn(48, 32), torch.randn(64, 48)
    outs = []
    for recipe in (bf16(), rotated):
        xp, wp = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp4_linear(xp, wp, None, recipe, name="l")
        y.backward(dy)
        outs.append((y.detach(), xp.grad, wp.grad))
    assert not torch.equal(rec.seen["fprop", "a"][2], x)  # the operands really were rotated
    assert not torch.equal(rec.seen["fprop", "b"][2], w)
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[1][1], outs[0][1]) and torch.equal(outs[1][2], outs[0][2])  # the backward as it was


@pytest.mark.parametrize("mode", ["deterministic", "fixed", "random"])
@pytest.mark.parametrize("size", [16, 32])
def test_hadamard_cancels_in_wgrad(mode, size, monkeypatch):
    if mode == "fixed" and size == 32:
        pytest.skip("covered by random signs drawn once")
    rec = _Recorder(monkeypatch)
    rotated = Recipe(wgrad=GemmSpec(hadamard=mode, hadamard_size=size))
    x, w = torch.randn(64, 32, dtype=torch.float64).float(), torch.randn(48, 32)
    dy = torch.randn(64, 48)
    grads = []
    for recipe in (bf16(), rotated):
        wp = w.clone().requires_grad_()
        fp4_linear(x, wp, None, recipe, name="l").backward(dy)
        grads.append(wp.grad)
    assert not torch.equal(rec.seen["wgrad", "a"][2], dy)  # the operand really was rotated
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


def test_stochastic_rounding_of_gradients_is_unbiased_over_steps():
    """dgrad with dy stochastically rounded (W kept BF16): the mean over steps converges to the
    exact dy @ W (chi-square of the z-scores ~ 1), while RTNE keeps a fixed bias. Every block of
    dy holds the tensor amax, so block scales are exact and nothing saturates (a block scale
    that rounds down clips its largest element: a bias no rounding mode removes)."""
    torch.manual_seed(2)
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    dy = torch.randn(16, 32).clamp(-2.9, 2.9)
    dy[:, ::16] = 3.0
    exact = dy @ w

    def dgrad(rounding, tick):
        spec = GemmSpec(a=Operand(format="nvfp4", rounding=rounding))
        xp = x.clone().requires_grad_()
        fp4_linear(xp, w, None, Recipe(dgrad=spec), name="l", context=QuantContext(tick=tick)).backward(dy)
        return xp.grad

    samples = torch.stack([dgrad("stochastic", t) for t in range(200)]).double()
    mean, sem = samples.mean(0), samples.std(0) / 200 ** 0.5
    chi2 = (((mean - exact) / sem) ** 2).mean()
    assert 0.6 < chi2 < 1.5, chi2
    rtne_bias = (dgrad("rtne", 0) - exact).norm()
    assert (mean - exact).norm() < rtne_bias / 4
    assert torch.equal(dgrad("stochastic", 7), dgrad("stochastic", 7))
    assert not torch.equal(dgrad("stochastic", 7), dgrad("stochastic", 8))


def test_data_parallel_ranks_draw_their_own_rounding_bytes():
    """The same gradient shard on ranks 0 and 1 rounds differently (independent noise to average);
    rank 0 keeps the single-process seeds, so a 1-GPU run's bytes do not depend on DDP existing."""
    torch.manual_seed(3)
    x, w, dy = torch.randn(16, 64), torch.randn(32, 64), torch.randn(16, 32)
    recipe = Recipe(dgrad=GemmSpec(a=Operand(format="nvfp4", rounding="stochastic")))

    def dgrad(context):
        xp = x.clone().requires_grad_()
        fp4_linear(xp, w, None, recipe, name="l", context=context).backward(dy)
        return xp.grad
    assert torch.equal(dgrad(QuantContext(tick=5, rank=0)), dgrad(QuantContext(tick=5)))
    assert not torch.equal(dgrad(QuantContext(tick=5, rank=1)), dgrad(QuantContext(tick=5)))
    assert torch.equal(dgrad(QuantContext(tick=5, rank=1)), dgrad(QuantContext(tick=5, rank=1)))


def test_ragged_dims_are_padded_and_late_training_switches_to_bf16():
    torch.manual_seed(3)
    x, w = torch.randn(5, 40), torch.randn(24, 40)
    y = fp4_linear(x, w, None, preset("nvfp4_plain"), name="l")
    assert y.shape == (5, 24) and torch.isfinite(y).all()
    assert (y - x @ w.T).norm() / (x @ w.T).norm() < 0.2
    late = dataclasses.replace(preset("nvfp4_plain"), bf16_after=0.5)
    assert torch.equal(fp4_linear(x, w, None, late, name="l", context=QuantContext(progress=0.6)), x @ w.T)


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="does not match weight"):
        fp4_linear(torch.randn(4, 32), torch.randn(8, 48), None, nvfp4())


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4_hadamard"])
@pytest.mark.parametrize("n,k", [(16, 32), (20, 40)])
def test_triton_path_gives_the_reference_bytes(n, k, name, monkeypatch):
    """Under TRITON_INTERPRET=1 (CI) or on CUDA: the Triton quantizers feed the same operands; with
    a ragged weight (20 x 40: padded 16x16 tiles) holding an Inf, dgrad's reused values too; with
    MXFP4, wgrad's operands rotated in the quantize pass."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(4)
    x = torch.randn(32, k, device=dev)
    w, dy = torch.randn(n, k, device=dev), torch.randn(32, n, device=dev)
    if n == 20:
        w[3, 7] = float("inf")
    seen = {}
    from fp4lab.kernels import quantize as triton_quantize
    for backend in ("reference", "triton"):
        monkeypatch.setenv("FP4LAB_BACKEND", backend)
        rec = _Recorder(monkeypatch)
        fused = []
        real = triton_quantize.try_block_values_pair  # (block_values_pair's launches; None where refused)

        def spy(*a, real=real, **kw):
            got = real(*a, **kw)
            fused.extend([1] * (got is not None))
            return got
        monkeypatch.setattr(triton_quantize, "try_block_values_pair", spy)
        wp = w.clone().requires_grad_()
        fp4_linear(x.clone().requires_grad_(), wp, None, preset(name), name="l",
                   context=QuantContext(tick=1)).backward(dy)
        seen[backend] = dict(rec.seen)
        # x for fprop and wgrad, dy for dgrad and wgrad: each read once for both of its copies where the
        # pair kernel covers the shape (K, or N for dy, a multiple of the block), else one copy at a time
        assert rec.pairs == [(("fprop", "a"), ("wgrad", "b")), (("dgrad", "a"), ("wgrad", "a"))]
        block = 16 if name == "nvfp4" else 32
        assert len(fused) == (backend == "triton") * ((k % block == 0) + (n % block == 0))
        monkeypatch.undo()  # one spy at a time
    # on both backends NVIDIA's recipe lets dgrad multiply fprop's weight values transposed
    assert set(seen["reference"]) == set(seen["triton"])
    assert (("dgrad", "b") not in seen["triton"]) == (name == "nvfp4")
    for key, (_, _, q) in seen["reference"].items():
        _same(seen["triton"][key][2], q)


def test_each_dense_gemm_gets_the_alpha_the_pair_kernel_wrote(monkeypatch):
    """NVIDIA's recipe on the Triton path: x's pair writes fprop's alpha against the weight's
    tensor scale, dy's pair dgrad's (the weight's) and wgrad's (x's columns copy), so each of the
    three GEMMs gets one alpha (cuBLASLt launches nothing for a product); the layer's output and
    gradients are the reference backend's bits."""
    pytest.importorskip("triton")
    from fp4lab.kernels import matmul
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(6)
    x, w, dy = torch.randn(32, 64, device=dev), torch.randn(48, 64, device=dev), torch.randn(32, 48, device=dev)
    out = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("FP4LAB_BACKEND", backend)
        alphas, real = [], matmul.scaled_mm
        monkeypatch.setattr(matmul, "scaled_mm", lambda a, b, alpha, **kw: alphas.append(alpha) or real(a, b, alpha, **kw))
        xp, wp = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp4_linear(xp, wp, None, nvfp4(), name="l", context=QuantContext(tick=3))
        y.backward(dy)
        out[backend] = (y, xp.grad, wp.grad)
        if backend == "triton":
            assert len(alphas) == 3 and all(isinstance(a, torch.Tensor) and a.numel() == 1 for a in alphas)
        monkeypatch.undo()
    for fast, ref in zip(out["triton"], out["reference"]):
        assert torch.equal(fast.view(torch.int32) if fast.dtype == torch.float32 else fast, ref.view(torch.int32)
                           if ref.dtype == torch.float32 else ref)


def test_pair_off_quantizes_one_copy_at_a_time_to_the_same_bytes(monkeypatch):
    """FP4LAB_PAIR=0 (the escape hatch should the pair kernel misbehave on some device): no pair,
    every operand quantized on its own, the same bytes and gradients as with the pair."""
    torch.manual_seed(5)
    x, w, dy = torch.randn(32, 64), torch.randn(48, 64), torch.randn(32, 48)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("FP4LAB_PAIR", flag)
        rec = _Recorder(monkeypatch)
        xp, wp = x.clone().requires_grad_(), w.clone().requires_grad_()
        fp4_linear(xp, wp, None, nvfp4(), name="l", context=QuantContext(tick=2)).backward(dy)
        runs[flag] = (rec, xp.grad, wp.grad)
        monkeypatch.undo()
    assert runs["1"][0].pairs and not runs["0"][0].pairs
    assert set(runs["1"][0].seen) == set(runs["0"][0].seen)
    for key, (_, _, q) in runs["1"][0].seen.items():
        _same(runs["0"][0].seen[key][2], q)
    assert torch.equal(runs["1"][1], runs["0"][1]) and torch.equal(runs["1"][2], runs["0"][2])


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp4_hadamard", "nvfp4_dither", "nvfp4_fprop_hadamard",
                                  "four_over_six_w1x16_fprop_hadamard"])
def test_triton_path_multiplies_the_same_operands(name, monkeypatch):
    """On the Triton backend (the interpreter here) GEMM operands are quantized straight to
    BlockValues by the kernel: the same function as the reference path up to fp32 summation
    order (at most one bf16 rounding step apart)."""
    pytest.importorskip("triton")  # without CUDA, tests/conftest.py set TRITON_INTERPRET=1
    recipe = nvfp4().override({"fprop.b.dither": 0.5, "dgrad.b.dither": 0.5}) if name == "nvfp4_dither" else \
        _VARIANTS.get(name, lambda: preset(name))()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("FP4LAB_BACKEND", backend)
        rec = _Recorder(monkeypatch)
        torch.manual_seed(0)
        x = torch.randn(40, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
        w = (torch.randn(48, 64, device=device) * 0.05).requires_grad_()
        dy = torch.randn(40, 48, dtype=torch.bfloat16, device=device)
        with torch.autocast(device, dtype=torch.bfloat16):
            y = fp4_linear(x, w, None, recipe, name="l", context=QuantContext(tick=3))
        y.backward(dy)
        results[backend] = [t.detach().float().cpu() for t in (y, x.grad, w.grad)]
        kinds = {key: type(out).__name__ for key, (_, _, out) in rec.seen.items()}
        assert set(kinds.values()) == {"BlockValues"}  # the operand form does not depend on the backend
        reused = make_call(recipe, "l", QuantContext(tick=3)).dgrad_reuses_fprop_weight()
        assert reused == (name in ("nvfp4", "nvfp4_dither"))  # NVIDIA's 16x16 RTNE weights, unrotated
        assert (("dgrad", "b") not in kinds) == reused
    for fast, ref in zip(results["triton"], results["reference"]):
        torch.testing.assert_close(fast, ref, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "nvfp4_four_over_six"])
def test_a_bf16_forward_context_serves_fp4_weights_in_bf16(name):
    # the trainer's last evaluation scores an FP4 run's weights this way (train.loop)
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    x = torch.randn(2, 16, 64)
    layer = FP4Linear.from_linear(ref, preset(name), name="blocks.0.mlp.fc", context=QuantContext(forward_bf16=True))
    fp4 = FP4Linear.from_linear(ref, preset(name), name="blocks.0.mlp.fc", context=QuantContext())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, served, quantized = ref(x), layer(x), fp4(x)
    assert torch.equal(served, want)
    assert not torch.equal(quantized, want)


@settings(max_examples=200, deadline=None)
@given(firsts=st.lists(st.integers(-(2**63), 2**64 - 1), max_size=70),
       parts=st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4))
def test_seeds_of_every_group_at_once_equal_the_fold_per_group(firsts, parts):
    """derive_seeds (an MoE projection's experts in one uint64 array pass) is derive_seed per
    element, wrap-around and negative parts included."""
    assert derive_seeds(firsts, *parts) == [derive_seed(f, *parts) for f in firsts]


@pytest.mark.parametrize("gemm, hadamard", [("wgrad", HadamardMode.RANDOM), ("wgrad", HadamardMode.FIXED),
                                            ("wgrad", HadamardMode.DETERMINISTIC), ("fprop", HadamardMode.NONE)])
def test_group_seeds_are_each_calls_seeds(gemm, hadamard):
    recipe = nvfp4().override({"wgrad.hadamard": hadamard.value, "wgrad.hadamard_size": 32 if
                               hadamard is HadamardMode.FIXED else 16})
    calls = [make_call(recipe, f"blocks.1.moe.up.{e}", QuantContext(tick=11)) for e in range(9)]
    for side in "ab":
        assert G._group_seeds(calls, gemm, side) == [c.seed(gemm, side) for c in calls]
    if hadamard is not HadamardMode.NONE:
        assert G._group_rotation_seeds(calls, gemm) == [c.rotation(gemm).seed for c in calls]


def test_wgrads_copy_of_x_lives_as_long_as_x_would():
    """A dense layer keeps wgrad's copy of x (made with fprop's in one read) in place of x, through
    save_for_backward: autograd frees it after the backward, as it would have freed x."""
    import gc
    import weakref
    x = torch.randn(40, 64, requires_grad=True)
    w = (torch.randn(48, 64) * 0.05).requires_grad_()
    y = fp4_linear(x, w, None, nvfp4(), name="l", context=QuantContext(tick=1))
    node = y.grad_fn  # the three GEMMs' node (x and the weight flattened inside it: no view nodes)
    saved = node.saved_tensors
    assert saved[0] is None and len(saved) == 4  # no x; weight, wgrad's values and tensor scale
    assert saved[2].shape == (64, 64)  # [K, tokens padded to 64]
    kept = weakref.ref(saved[2])
    del saved
    y.sum().backward()
    gc.collect()
    assert kept() is None and "x_wgrad" not in node.saved


def test_a_dense_layer_is_one_autograd_node_with_the_bits_of_a_flat_call():
    """x [..., K] and the weight are flattened inside the autograd function (no view nodes, each an
    engine step in backward): the graph is the one node over the leaves, and outputs and
    gradients are those of the same call on x flattened by hand."""
    torch.manual_seed(7)
    x = torch.randn(2, 24, 64)
    w, b = torch.randn(48, 64) * 0.05, torch.randn(48)
    dy = torch.randn(2, 24, 48)
    outs = []
    for shaped in (True, False):
        xi = (x if shaped else x.reshape(-1, 64)).clone().requires_grad_()
        wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
        y = fp4_linear(xi, wi, bi, nvfp4(), name="l", context=QuantContext(tick=3))
        if shaped:
            assert {type(f).__name__ for f, _ in y.grad_fn.next_functions} == {"AccumulateGrad"}
        y.backward(dy.reshape(y.shape))
        outs.append((y.reshape(-1, 48), xi.grad.reshape(-1, 64), wi.grad, bi.grad))
    for a, c in zip(*outs):
        assert torch.equal(a, c)


@pytest.mark.parametrize("shape", [(40, 64), (2, 20, 64)])
def test_the_output_can_be_modified_in_place(shape):
    """A residual add or an in-place activation on the layer's output (autograd refuses in-place
    changes to an output that is a view made inside the function): gradients as out of place."""
    torch.manual_seed(8)
    x, w = torch.randn(*shape), torch.randn(48, 64) * 0.05
    grads = []
    for in_place in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp4_linear(xi, wi, None, nvfp4(), name="l", context=QuantContext(tick=1))
        y = torch.relu_(y.add_(0.5)) if in_place else torch.relu(y + 0.5)
        y.sum().backward()
        grads.append((xi.grad, wi.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(inplace=True), torch.nn.Linear(64, 16))
    from fp4lab.nn import quantize_model
    quantize_model(model, nvfp4())
    model(torch.randn(8, 64)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
