"""nn.linear.grouped_fp4_linear: all experts' FP4 GEMMs through the one three-GEMM body equal a
loop of fp4_linear calls over the experts, on the reference and on the Triton backend (the
interpreter here, CUDA on the device machine: one launch for all experts' fprop and dgrad)."""

import importlib.util

import pytest
import torch

from fp4lab.kernels import GroupedValues
from fp4lab.nn import MoE, MoEConfig, quantize_model
from fp4lab.nn import gemms as gemms_module
from fp4lab.nn import moe as moe_module
from fp4lab.nn.linear import QuantContext, fp4_linear, grouped_fp4_linear
from fp4lab.nn.recipe import nvfp4, preset
from fp4lab.nn.seeds import SeedTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (TRITON_INTERPRET=1 on a CPU)"))]


def _per_expert_loop(x, w, counts, recipe, *, name, context, label="", keys=None):
    """What grouped_fp4_linear promises: fp4_linear per expert, named f"{name}.{e}.{label}"."""
    outs = [fp4_linear(x_e, w[e], None, recipe, name=f"{name}.{e}.{label}", context=context)
            for e, x_e in enumerate(x.split(counts)) if x_e.shape[0]]
    return torch.cat(outs) if outs else x.new_zeros(x.shape[0], w.shape[1])


def _run(recipe, grouped: bool, backend: str, monkeypatch, *, all_live: bool = False, table: bool = False,
         compiled: bool = False):
    monkeypatch.setenv("FP4LAB_BACKEND", backend)
    if not grouped:
        monkeypatch.setattr(moe_module, "grouped_fp4_linear", _per_expert_loop)
    torch.manual_seed(0)
    moe = MoE(64, MoEConfig(n_experts=4, top_k=2, n_shared=0, expert_hidden=64)).to(DEVICE)
    if not all_live:
        moe.bias.copy_(torch.tensor([0.0, 0.0, -5.0, 0.0]))  # expert 2 gets no rows
    context = quantize_model(torch.nn.Sequential(moe), recipe)
    if table:  # seeds in device slots, as a graphed step reads them (a small table: it grows)
        context.seeds = SeedTable(DEVICE, capacity=4)
    context.tick = 7
    x = torch.randn(2, 24, 64, device=DEVICE, requires_grad=True)
    if compiled:  # fullgraph: a host read of the counts (a graph break) is an error
        torch._dynamo.reset()
    run = torch.compile(moe, fullgraph=True, backend="aot_eager") if compiled else moe
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = run(x)
    y.float().square().sum().backward()
    monkeypatch.undo()
    grads = [x.grad] + [p.grad for p in (moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down)]
    return [t.detach().float().cpu() for t in (y, *grads)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_all_live", "mxfp4", "fprop", "late_bf16"])
def test_grouped_experts_equal_the_per_expert_loop(name, backend, monkeypatch):
    """(late_bf16: NVIDIA's recipe after its switch to BF16, the body's BF16 grouped GEMMs; the
    bf16 recipe itself swaps nothing, its experts run torch._grouped_mm without the body.
    nvfp4_all_live: every expert gets rows, so fprop quantizes all experts' weights in one launch
    and dgrad multiplies those tiles transposed, as one GroupedValues read in place.)"""
    all_live = name == "nvfp4_all_live"
    name = "nvfp4" if all_live else name
    overrides = {"keep_first": 0, "keep_last": 0} | ({"bf16_after": 0.0} if name == "late_bf16" else {})
    recipe = preset("nvfp4" if name == "late_bf16" else name)
    recipe = recipe.override(overrides) if name in ("nvfp4", "late_bf16") else recipe
    transposed, copies = [], []  # dgrad's weights taken as one GroupedValues (every expert live), read transposed
    spy, copy = GroupedValues.transposed_stack, GroupedValues.transposed
    monkeypatch.setattr(GroupedValues, "transposed_stack",
                        lambda self, rows: (transposed.append(rows), spy(self, rows))[1])
    monkeypatch.setattr(GroupedValues, "transposed", lambda self, rows: (copies.append(rows), copy(self, rows))[1])
    # the counts read on the host (the device counts' bits are those: test_counts_kept_on_the_device_...)
    monkeypatch.setattr(moe_module.GroupedExperts, "counts_kept", False)
    grouped = _run(recipe, True, backend, monkeypatch, all_live=all_live)
    assert bool(transposed) == all_live
    assert bool(copies) == (all_live and backend == "reference")  # the Triton GEMM reads them in place
    monkeypatch.setattr(moe_module.GroupedExperts, "counts_kept", False)
    loop = _run(recipe, False, backend, monkeypatch, all_live=all_live)
    if not all_live:
        assert float(grouped[2][2].abs().max()) == 0  # the expert without rows gets no gradient
    for g, ref in zip(grouped, loop):
        if backend == "reference":  # the same operands and the same fp32 matmuls: bit for bit
            assert torch.equal(g, ref)
        else:  # one grouped launch: the fp32 summation order may differ
            torch.testing.assert_close(g, ref, rtol=2**-7, atol=1e-5)


def _expert_tensors(dtype: torch.dtype, seed: int):
    """Three experts' weights [3, 32, 64] and 16 rows of x, both leaves in ``dtype``."""
    torch.manual_seed(seed)
    w = (torch.randn(3, 32, 64, device=DEVICE) * 0.1).to(dtype).requires_grad_()
    return w, torch.randn(16, 64, device=DEVICE).to(dtype).requires_grad_()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_and_no_rows_at_all(backend, monkeypatch):
    """fp16 compute (results via fp32, as the per-expert loop) and a batch routed to no expert rows."""
    monkeypatch.setenv("FP4LAB_BACKEND", backend)
    w, x = _expert_tensors(torch.float16, 1)
    y = grouped_fp4_linear(x, w, [5, 0, 11], nvfp4(), name="e", context=QuantContext())
    assert y.dtype == torch.float16 and y.shape == (16, 32) and bool(y.isfinite().all())
    y.float().sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and float(w.grad[1].abs().max()) == 0
    empty = torch.zeros(0, 64, device=DEVICE, requires_grad=True)
    y0 = grouped_fp4_linear(empty, w, [0, 0, 0], nvfp4(), name="e", context=QuantContext())
    assert y0.shape == (0, 32)
    y0.sum().backward()
    assert empty.grad.shape == (0, 64)


def test_counts_that_do_not_match_are_refused():
    w = torch.randn(3, 32, 64)
    with pytest.raises(ValueError, match="counts"):
        grouped_fp4_linear(torch.randn(16, 64), w, [5, 5, 5], nvfp4(), name="e", context=QuantContext())


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_grouped_gemms_take_any_gradient_layout(backend, monkeypatch):
    # y.sum().backward() hands the GEMMs an expanded dy (stride 0), which torch._grouped_mm refuses
    monkeypatch.setenv("FP4LAB_BACKEND", backend)
    w, x = _expert_tensors(torch.bfloat16, 2)
    for counts in ([5, 0, 11], [16, 0, 0]):
        x.grad = w.grad = None
        grouped_fp4_linear(x, w, counts, preset("bf16"), name="e", context=QuantContext()).sum().backward()
        got = (x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        _per_expert_loop(x, w, counts, preset("bf16"), name="e", context=QuantContext()).sum().backward()
        for g, ref in zip(got, (x.grad, w.grad)):
            torch.testing.assert_close(g.float(), ref.float(), rtol=2**-7, atol=1e-5)
        assert float(got[1][1].abs().max()) == 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (TRITON_INTERPRET=1 on a CPU)")
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_all_live", "nvfp4_random_signs", "nvfp4_plain", "mxfp4",
                                  "mxfp4_hadamard"])
def test_counts_kept_on_the_device_give_the_host_counts_bits(name, monkeypatch):
    """FP4 experts given the routing's counts as a device tensor (never read on the host: what a
    CUDA graph captures), an expert without rows included, give the outputs and gradients of the
    same counts read on the host, bit for bit (the Triton kernels; on a CPU, interpreted). They do
    where the step's seeds are a SeedTable's slots (a graphed step draws them so; a small table
    that grows); an eager step without one, or FP4LAB_DEVICE_COUNTS=0, reads them on the host."""
    all_live = name == "nvfp4_all_live"
    base = "nvfp4" if name.startswith("nvfp4_") and name != "nvfp4_plain" else name
    recipe = preset(base)
    if base == "nvfp4":
        recipe = recipe.override({"keep_first": 0, "keep_last": 0}
                                 | ({"wgrad.hadamard": "random"} if name == "nvfp4_random_signs" else {}))
    monkeypatch.setattr(moe_module.GroupedExperts, "counts_kept", False)
    host = _run(recipe, True, "triton", monkeypatch, all_live=all_live)  # (undoes the patch)
    seen, spy = [], moe_module.grouped_fp4_linear

    def watched(env: str, table: bool = False) -> list:  # records whether each projection got device counts
        seen.clear()
        monkeypatch.setenv("FP4LAB_DEVICE_COUNTS", env)
        monkeypatch.setattr(moe_module, "grouped_fp4_linear", lambda x, w, counts, *a, **k: (
            seen.append(isinstance(counts, torch.Tensor)), spy(x, w, counts, *a, **k))[1])
        return _run(recipe, True, "triton", monkeypatch, all_live=all_live, table=table)  # (undoes the patches)
    kept = watched("1", table=True)
    assert seen and all(seen)  # every projection took the device counts
    assert all(torch.equal(a, b) for a, b in zip(watched("1"), host))  # eager, no table: host counts
    assert seen and not any(seen)
    assert all(torch.equal(a, b) for a, b in zip(watched("0", table=True), host))  # the fallback: host counts,
    assert seen and not any(seen)                                                  # seeds in slots
    for a, b in zip(kept, host):
        assert torch.equal(a, b)
    if not all_live:
        assert float(kept[2][2].abs().max()) == 0  # the expert without rows gets an exact zero gradient


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (TRITON_INTERPRET=1 on a CPU)")
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_a_compiled_fp4_moe_layer_keeps_the_counts_on_the_device_in_one_graph(name, monkeypatch):
    """Compiled, with the step's seeds in a SeedTable (a graphed step), FP4 experts hand the
    routing's counts to the custom ops as a tensor: the MoE layer is one graph (fullgraph: no host
    read of the counts) and gives the eager host counts' outputs and gradients, bit for bit."""
    recipe = preset(name)
    if name == "nvfp4":
        recipe = recipe.override({"keep_first": 0, "keep_last": 0})
    made, weights_at_once = [], gemms_module._fprop_weights_at_once

    def counted(weight, calls):  # every expert's weight tiles made in one launch, forward or backward
        made.append(weight.shape)
        return weights_at_once(weight, calls)
    monkeypatch.setattr(gemms_module, "_fprop_weights_at_once", counted)
    host = _run(recipe, True, "triton", monkeypatch, all_live=True)  # (undoes the patch)
    eager_made, made[:] = list(made), []
    seen, spy = [], moe_module.grouped_fp4_linear
    monkeypatch.setattr(moe_module, "grouped_fp4_linear", lambda x, w, counts, *a, **k: (
        seen.append(isinstance(counts, torch.Tensor)), spy(x, w, counts, *a, **k))[1])
    monkeypatch.setattr(gemms_module, "_fprop_weights_at_once", counted)
    got = _run(recipe, True, "triton", monkeypatch, table=True, compiled=True, all_live=True)  # (undoes the patches)
    assert seen and all(seen)
    for a, b in zip(got, host):
        assert torch.equal(a, b)
    # the forward op hands its backward fprop's weight tiles (NVFP4's 16x16), as eager keeps them:
    # each projection's made once, not again for dgrad
    assert len(made) == len(eager_made) == (3 if name == "nvfp4" else len(made))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (TRITON_INTERPRET=1 on a CPU)")
def test_a_compiled_moe_layer_asks_the_device_count_rule_outside_the_trace(monkeypatch):
    """The rule asks the machine (importlib's find_spec, the device's capability), which torch
    2.11's dynamo will not trace: on the H100 the test above broke its graph there. Compiled, the
    rule runs outside the trace and its answer is a constant. A rule that breaks any trace
    stands in for it, so this fails on every torch version if the rule is traced again."""
    rule, asked = moe_module.steps_keep_counts, []

    def untraceable(*args, **kwargs):
        torch._dynamo.graph_break()  # (a no-op outside a trace)
        asked.append(args)
        return rule(*args, **kwargs)
    monkeypatch.setattr(moe_module, "steps_keep_counts", untraceable)
    seen, spy = [], moe_module.grouped_fp4_linear
    monkeypatch.setattr(moe_module, "grouped_fp4_linear", lambda x, w, counts, *a, **k: (
        seen.append(isinstance(counts, torch.Tensor)), spy(x, w, counts, *a, **k))[1])
    recipe = preset("nvfp4").override({"keep_first": 0, "keep_last": 0})
    _run(recipe, True, "triton", monkeypatch, table=True, compiled=True)  # fullgraph (undoes the patches)
    assert asked and seen and all(seen)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (TRITON_INTERPRET=1 on a CPU)")
def test_a_compiled_moe_layer_sees_the_environment_the_rule_reads_change(monkeypatch):
    """The rule's answer is a constant in the compiled graph, but what it reads from the
    environment is read where the graph guards on it: FP4LAB_DEVICE_COUNTS=0 after a compiled
    call recompiles to host counts, where a stale constant would keep the device's."""
    monkeypatch.setenv("FP4LAB_BACKEND", "triton")
    monkeypatch.setenv("FP4LAB_DEVICE_COUNTS", "1")
    torch.manual_seed(0)
    moe = MoE(64, MoEConfig(n_experts=4, top_k=2, n_shared=0, expert_hidden=64)).to(DEVICE)
    context = quantize_model(torch.nn.Sequential(moe), preset("nvfp4").override({"keep_first": 0, "keep_last": 0}))
    context.seeds, context.tick = SeedTable(DEVICE, capacity=4), 7
    seen, spy = [], moe_module.grouped_fp4_linear
    monkeypatch.setattr(moe_module, "grouped_fp4_linear", lambda x, w, counts, *a, **k: (
        seen.append(isinstance(counts, torch.Tensor)), spy(x, w, counts, *a, **k))[1])
    torch._dynamo.reset()
    run = torch.compile(moe, backend="aot_eager")
    x = torch.randn(2, 24, 64, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16), torch.no_grad():
        first = run(x)
        kept, seen[:] = list(seen), []
        monkeypatch.setenv("FP4LAB_DEVICE_COUNTS", "0")
        second = run(x)
    assert kept and all(kept)  # device counts
    assert seen and not any(seen)  # host counts, after the recompile
    assert torch.equal(first, second)  # the same bits either way


def test_which_recipes_keep_the_counts_on_the_device():
    """The rule (nn.gemms.counts_stay_on_device): every GEMM either quantizes all experts'
    activations in one launch or stays BF16 on torch._grouped_mm (CUDA sm_90); statistics, a
    rotated forward or dithered activations read the counts on the host."""
    from fp4lab.nn.gemms import counts_stay_on_device
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    mp = pytest.MonkeyPatch()
    mp.setenv("FP4LAB_BACKEND", "triton")
    mp.setenv("TRITON_INTERPRET", "1")
    try:
        assert counts_stay_on_device(nvfp4(), cpu, bf16, 64, 64)
        assert not counts_stay_on_device(nvfp4(), cpu, bf16, 64, 64, collect=True)
        assert not counts_stay_on_device(nvfp4().override({"fprop.hadamard": "deterministic"}), cpu, bf16, 64, 64)
        # a dithered weight goes expert by expert (each its own seed slot): the counts still stay
        assert counts_stay_on_device(nvfp4().override({"fprop.b.dither": 1.0, "dgrad.b.dither": 1.0}), cpu, bf16, 64, 64)
        assert counts_stay_on_device(preset("nvfp4_four_over_six"), cpu, bf16, 64, 64)
        assert not counts_stay_on_device(preset("fprop"), cpu, bf16, 64, 64)  # (dgrad, wgrad in BF16)
        # FP4 activations times BF16 weights: no grouped multiply for them
        assert not counts_stay_on_device(nvfp4().override({"fprop.b.format": "bf16", "fprop.b.block2d": False}),
                                         cpu, bf16, 64, 64)
        # a GEMM left in BF16 needs torch._grouped_mm, which runs on CUDA sm_90+ only: not here
        assert not counts_stay_on_device(nvfp4().override({"bf16_after": 0.0}).at_progress(0.5), cpu, bf16, 64, 64)
        experts = MoE(64, MoEConfig(n_experts=4, top_k=2, n_shared=0, expert_hidden=64)).experts
        quantize_model(torch.nn.Sequential(experts), nvfp4().override({"keep_first": 0, "keep_last": 0}))
        assert experts.counts_on_device()
        experts.context.seeds = SeedTable("cpu", capacity=4)  # a graphed run's seeds
        assert experts._fp4_counts_kept(cpu, bf16)
        experts.context.forward_bf16 = True  # its BF16-forward evaluation: every GEMM BF16, never graphed
        assert not experts._fp4_counts_kept(cpu, bf16)
        experts.context.forward_bf16 = False
        # decided for the run, not at the step's progress (under torch.compile a rule read at the
        # progress is a guard on it: a recompile at the switch): after this late switch a GEMM is
        # BF16, which needs torch._grouped_mm, so neither side keeps the counts here
        late = MoE(64, MoEConfig(n_experts=4, top_k=2, n_shared=0, expert_hidden=64)).experts
        context = quantize_model(torch.nn.Sequential(late), nvfp4().override(
            {"keep_first": 0, "keep_last": 0, "bf16_after": 0.5}))
        context.seeds = SeedTable("cpu", capacity=4)
        kept = []
        for progress in (0.0, 0.9):
            context.progress = progress
            kept.append(late._fp4_counts_kept(cpu, bf16))
        assert kept == [False, False] and not late.counts_on_device()
        mp.setenv("FP4LAB_DEVICE_COUNTS", "0")
        assert not experts.counts_on_device()
        mp.setenv("FP4LAB_BACKEND", "reference")
        assert not counts_stay_on_device(nvfp4(), cpu, bf16, 64, 64)
    finally:
        mp.undo()
