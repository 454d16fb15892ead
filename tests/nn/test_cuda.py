"""The nn layer on the GPU: Triton-path operands equal fp4lab.formats by hand at real sizes, and
an NVFP4 model's forward + backward matches the reference path (run on the device machine)."""

import pytest
import torch

from fp4lab.nn import GPT, model_config, quantize_model
from fp4lab.nn import linear as L
from fp4lab.nn.linear import QuantContext, fp4_linear
from fp4lab.nn.quant import derive_seed
from fp4lab.nn.recipe import PRESETS, nvfp4, preset

from .test_linear import _by_hand, _Recorder, _same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", PRESETS)
def test_triton_operands_equal_formats_by_hand_at_real_sizes(name, monkeypatch):
    recipe = preset(name)
    rec = _Recorder(monkeypatch)
    torch.manual_seed(0)
    m, k, n = 4096, 1024, 1536
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda") * 0.02).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-4
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fp4_linear(x, w, None, recipe, name="blocks.3.attn.qkv", context=QuantContext(tick=11)).backward(dy)
    root = derive_seed(recipe.seed, L.layer_key("blocks.3.attn.qkv"), 11)
    seen = dict(rec.seen)
    if ("dgrad", "a") in seen and ("dgrad", "b") not in seen:  # dgrad multiplied fprop's weight values
        t, _, values = seen["fprop", "b"]
        seen["dgrad", "b"] = (t, 0, values.transposed(k))
    for (gemm, side), (t, axis, got) in seen.items():
        spec = recipe.gemm(gemm)
        want = _by_hand(t.cpu(), axis, getattr(spec, side), spec, recipe, root, gemm, side)
        _same(got if not isinstance(got, torch.Tensor) else got.cpu(), want)


def test_nvfp4_model_step_matches_the_reference_path(monkeypatch):
    results = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("FP4LAB_BACKEND", backend)
        torch.manual_seed(0)
        model = GPT(model_config("d6", vocab_size=8192, seq_len=512)).cuda()
        context = quantize_model(model, nvfp4())
        context.tick = 3
        g = torch.Generator(device="cuda").manual_seed(1)
        idx = torch.randint(0, 8192, (8, 513), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results[backend] = (loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]))
    (loss_r, grad_r), (loss_t, grad_t) = results["reference"], results["triton"]
    # same operands (bytes, tested above); the GEMMs differ only in fp32 summation order
    assert abs(loss_r - loss_t) < 1e-3 * abs(loss_r), (loss_r, loss_t)
    cos = torch.nn.functional.cosine_similarity(grad_r.float(), grad_t.float(), dim=0)
    assert cos > 0.999, float(cos)
    print(f"nvfp4 d6 step: loss reference {loss_r:.6f} triton {loss_t:.6f}; grad cosine {float(cos):.6f}")
