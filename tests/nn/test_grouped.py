"""nn.grouped: all experts' FP4 GEMMs in one launch equal the per-expert loop (Triton backend;
the interpreter here, CUDA on the device machine)."""

import pytest
import torch

from fp4lab.nn import MoE, MoEConfig, quantize_model
from fp4lab.nn import moe as moe_module
from fp4lab.nn.grouped import grouped_applies
from fp4lab.nn.linear import QuantContext
from fp4lab.nn.recipe import bf16, nvfp4, preset

pytest.importorskip("triton")  # without CUDA, tests/conftest.py set TRITON_INTERPRET=1
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(recipe, grouped: bool, monkeypatch):
    monkeypatch.setenv("FP4LAB_BACKEND", "triton")
    if not grouped:
        monkeypatch.setattr(moe_module, "grouped_applies", lambda *args: False)
    torch.manual_seed(0)
    moe = MoE(64, MoEConfig(n_experts=4, top_k=2, n_shared=0, expert_hidden=64)).to(DEVICE)
    moe.bias.copy_(torch.tensor([0.0, 0.0, -5.0, 0.0]))  # expert 2 gets no rows
    wrapper = torch.nn.Sequential(moe)
    context = quantize_model(wrapper, recipe)
    context.tick = 7
    x = torch.randn(2, 24, 64, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = moe(x)
    y.float().square().sum().backward()
    monkeypatch.undo()
    grads = [x.grad] + [p.grad for p in (moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down)]
    return [t.detach().float().cpu() for t in (y, *grads)]


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_grouped_experts_equal_the_per_expert_loop(name, monkeypatch):
    recipe = preset(name).override({"keep_first": 0, "keep_last": 0}) if name == "nvfp4" else preset(name)
    calls = []
    real = moe_module.grouped_fp4_linear
    monkeypatch.setattr(moe_module, "grouped_fp4_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    grouped = _run(recipe, True, monkeypatch)
    assert calls, "the grouped path did not run"
    loop = _run(recipe, False, monkeypatch)
    assert float(grouped[2][2].abs().max()) == 0  # the expert without rows gets no gradient
    for g, ref in zip(grouped, loop):  # the same operands; fp32 summation order may differ
        torch.testing.assert_close(g, ref, rtol=2**-7, atol=1e-5)


def test_grouped_path_is_chosen_only_where_it_applies(monkeypatch):
    x = torch.randn(4, 32, device=DEVICE)
    monkeypatch.setenv("FP4LAB_BACKEND", "triton")
    assert grouped_applies(nvfp4(), x, QuantContext())
    assert not grouped_applies(nvfp4(), x, QuantContext(collect=True))  # statistics need FP4Tensors
    assert not grouped_applies(bf16(), x, QuantContext())
    assert not grouped_applies(preset("fprop"), x, QuantContext())  # dgrad and wgrad stay BF16
    assert not grouped_applies(nvfp4().override({"bf16_after": 0.5}), x, QuantContext(progress=0.9))
    monkeypatch.setenv("FP4LAB_BACKEND", "reference")
    assert not grouped_applies(nvfp4(), x, QuantContext())


def test_fp16_and_no_rows_at_all(monkeypatch):
    """fp16 compute (results via fp32, as the per-expert loop) and a batch routed to no expert rows."""
    from fp4lab.nn.grouped import grouped_fp4_linear
    monkeypatch.setenv("FP4LAB_BACKEND", "triton")
    torch.manual_seed(1)
    w = (torch.randn(3, 32, 64, device=DEVICE) * 0.1).half().requires_grad_()
    x = torch.randn(16, 64, device=DEVICE).half().requires_grad_()
    y = grouped_fp4_linear(x, w, [5, 0, 11], nvfp4(), name="e", context=QuantContext())
    assert y.dtype == torch.float16 and y.shape == (16, 32) and bool(y.isfinite().all())
    y.float().sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and float(w.grad[1].abs().max()) == 0
    empty = torch.zeros(0, 64, device=DEVICE, requires_grad=True)
    y0 = grouped_fp4_linear(empty, w, [0, 0, 0], nvfp4(), name="e", context=QuantContext())
    assert y0.shape == (0, 32)
    y0.sum().backward()
    assert empty.grad.shape == (0, 64)
