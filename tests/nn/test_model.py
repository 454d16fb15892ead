"""Models and the model swap: BF16 recipe changes nothing, every preset trains, MoE balances."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp4lab.nn import GPT, FP4Linear, MoE, MoEConfig, QuantContext, fp4_modules, model_config, quantize_model
from fp4lab.nn.recipe import PRESETS, bf16, nvfp4, preset


def _model(name="tiny", seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(model_config(name, vocab_size=128, seq_len=64, **kw))


def _batch(seed=0, b=4, t=32):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 128, (b, t + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


@pytest.mark.parametrize("name", ["tiny", "moe-tiny"])
def test_bf16_recipe_swaps_nothing(name):
    """The BF16 arm is the model as users run it: nn.Linear and experts without a recipe."""
    plain, model = _model(name), _model(name)
    context = quantize_model(model, bf16().override({"embed_gain": 2.0}))
    assert not fp4_modules(model) and model.fp4_context is context
    assert repr(model).replace("embed_gain", "") == repr(plain).replace("embed_gain", "")
    assert model.embed_gain == 2.0  # gains still reach the model
    assert model.fp4_coverage["linears"]["fp4"] == 0


@pytest.mark.parametrize("name", ["tiny", "moe-tiny"])
def test_fp4_body_with_bf16_gemms_equals_the_plain_model(name):
    """The FP4 layers' three-GEMM body with every GEMM in BF16 (what a late switch to BF16 runs)
    computes the plain model's losses and gradients bit for bit."""
    plain, quant = _model(name), _model(name)
    keys, recipe, context = list(quant.state_dict()), bf16(), QuantContext()
    for n, m in list(quant.named_modules()):  # by hand: quantize_model leaves a BF16 recipe's model alone
        if hasattr(m, "use_recipe"):
            m.use_recipe(recipe, n, context)
            m.grouped_mm = False  # the body's reference path is the per-expert loop
        elif type(m) is nn.Linear and "router" not in n:
            parent, _, child = n.rpartition(".")
            setattr(quant.get_submodule(parent), child, FP4Linear.from_linear(m, recipe, name=n, context=context))
    for m in plain.modules():
        if hasattr(m, "grouped_mm"):
            m.grouped_mm = False
    assert list(quant.state_dict()) == keys
    idx, tgt = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        la, lb = plain(idx, tgt), quant(idx, tgt)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    for (n, p), q in zip(plain.named_parameters(), quant.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_swap_reuses_parameters_and_selects_layers():
    model = GPT(dataclasses.replace(model_config("tiny", vocab_size=128), depth=4))
    params = {n: p for n, p in model.named_parameters()}
    quantize_model(model, nvfp4(keep_first=1, keep_last=1))
    assert all(p is params[n] for n, p in model.named_parameters())
    swapped = set(fp4_modules(model))
    assert swapped == {f"blocks.{i}.{m}" for i in (1, 2) for m in
                       ("attn.qkv", "attn.proj", "ffn.gate", "ffn.up", "ffn.down")}
    assert type(model.lm_head) is nn.Linear
    with pytest.raises(ValueError, match="already has FP4 layers"):
        quantize_model(model, nvfp4())


def test_gains_are_set_from_the_recipe_and_need_a_model_with_gains():
    model = _model()
    quantize_model(model, nvfp4().override({"embed_gain": 10.667, "logits_gain": 0.125}))
    assert (model.embed_gain, model.logits_gain) == (10.667, 0.125)
    with pytest.raises(ValueError, match="no embed_gain"):
        quantize_model(nn.Sequential(nn.Linear(32, 32)), nvfp4().override({"embed_gain": 2.0}))


@pytest.mark.parametrize("name", PRESETS)
def test_a_tiny_model_trains_under_every_preset(name):
    model = _model()
    recipe = nvfp4(keep_first=0, keep_last=0) if name == "nvfp4" else preset(name)
    context = quantize_model(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, tgt = _batch()
    losses = []
    for step in range(12):
        context.tick = step
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses


def test_the_moe_model_trains_in_nvfp4():
    model = _model("moe-tiny")
    context = quantize_model(model, nvfp4(keep_first=0, keep_last=0))
    assert any(n.endswith("ffn.experts") for n in fp4_modules(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, tgt = _batch()
    first = None
    for step in range(10):
        context.tick = step
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        first = first or loss.item()
    assert float(loss) < 0.8 * first


def _naive_moe(moe: MoE, x):
    """Per token, per chosen expert: the definition, with no sorting or grouping."""
    x_TD = x.reshape(-1, x.shape[-1])
    scores = moe.router(x_TD).float().sigmoid()
    out = []
    for t in range(x_TD.shape[0]):
        top = torch.topk(scores[t] + moe.bias, moe.cfg.top_k).indices
        w = scores[t, top] / scores[t, top].sum()
        y = sum(w[i] * F.linear(F.silu(F.linear(x_TD[t], moe.experts.w_gate[e])) *
                                F.linear(x_TD[t], moe.experts.w_up[e]), moe.experts.w_down[e])
                for i, e in enumerate(top.tolist()))
        out.append(y + moe.shared(x_TD[t]))
    return torch.stack(out).reshape(x.shape)


def test_grouped_moe_equals_the_per_token_definition():
    torch.manual_seed(5)
    moe = MoE(32, MoEConfig(n_experts=8, top_k=3, n_shared=1, expert_hidden=32))
    for p in moe.parameters():
        nn.init.normal_(p, std=0.2)
    moe.bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(moe(x), _naive_moe(moe, x), rtol=1e-5, atol=1e-6)
    assert torch.equal(moe(x), moe(x))


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_bias_balancing_moves_load_toward_uniform(router):
    """A router that prefers experts 0 and 1: the per-expert bias evens the load out."""
    torch.manual_seed(6)
    moe = MoE(32, MoEConfig(n_experts=8, top_k=2, n_shared=0, expert_hidden=32, router=router, bias_rate=0.02))
    with torch.no_grad():
        moe.router.weight.normal_(std=0.05)
        moe.router.weight[:2] += 0.3
    x = torch.randn(512, 32) + 0.3  # a shared direction the skewed rows pick up
    imbalance = []
    with torch.no_grad():
        for _ in range(100):
            moe(x)
            imbalance.append(moe.routing_stats()["max_over_mean"])
            moe.update_bias()
    late = sum(imbalance[-20:]) / 20  # sign updates of a fixed size keep a small oscillation
    assert imbalance[0] > 3.0 and late < 1.8, (imbalance[0], late)


def test_aux_loss_reaches_the_router():
    moe = MoE(32, MoEConfig(n_experts=4, top_k=2, expert_hidden=32, aux_coef=0.01))
    moe(torch.randn(16, 32))
    moe.aux_loss.backward()
    assert moe.aux_loss > 0 and moe.router.weight.grad.abs().sum() > 0


def test_presets_are_sized_as_documented():
    with torch.device("meta"):
        sizes = {n: GPT(model_config(n)).num_params() for n in ("d6", "d12", "d16")}
        moe = GPT(model_config("moe64"))
    assert 25e6 < sizes["d6"] < 50e6 and 110e6 < sizes["d12"] < 170e6 and 250e6 < sizes["d16"] < 400e6, sizes
    assert moe.num_params(active=True) < moe.num_params() / 2
    assert moe.cfg.moe.n_experts == 64 and moe.cfg.moe.top_k == 6 and moe.cfg.moe.n_shared == 2


def test_too_long_sequences_are_rejected():
    with pytest.raises(ValueError, match="longer than the model's seq_len"):
        _model()(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys(qk_norm):
    # scaling the q and k rows of qkv changes the logits' temperature unless each head is normalised
    model = _model(qk_norm=qk_norm).double()
    idx, _ = _batch()
    before = model(idx)
    d = model.cfg.dim
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * d] *= 7.0
    after = model(idx)
    assert torch.allclose(before, after, atol=1e-9) == qk_norm


def test_qk_norm_model_trains():
    model = _model(qk_norm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx, tgt = _batch()
    first = None
    for _ in range(20):
        loss = model(idx, tgt)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.5


def test_bf16_experts_on_grouped_mm_equal_the_per_expert_loop():
    # torch._grouped_mm (one call for all experts) against the loop, with an expert left empty
    from fp4lab.nn.moe import grouped_mm_runs
    torch.manual_seed(0)
    experts = MoE(64, MoEConfig(n_experts=4, top_k=2, expert_hidden=32)).experts
    # else both arms would be the loop; rows must be 16-byte aligned (D and F multiples of 8)
    cpu = torch.device("cpu")
    assert grouped_mm_runs(cpu, torch.bfloat16, *experts.w_down.shape[1:]) and experts.counts_on_device()
    assert not grouped_mm_runs(cpu, torch.bfloat16, 60, 32) and not grouped_mm_runs(cpu, torch.float32, 64, 32)
    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(16, 64, requires_grad=True)
    dy = torch.randn(16, 64, dtype=torch.bfloat16)
    results = []
    for grouped in (True, False):
        experts.grouped_mm = grouped
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = experts(x, counts)
        assert y.dtype == torch.bfloat16
        results.append((y, *torch.autograd.grad(y, (x, experts.w_gate, experts.w_up, experts.w_down), dy)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-4)  # bf16 products, sums in another order
    assert results[0][2][1].abs().max() == 0  # the empty expert gets no gradient
