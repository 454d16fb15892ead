"""NVFP4 MoE inference: staged bytes equal formats' quantizers, the pipeline equals the plain
reference to fp32 summation order, the FP4 error vs the FP32 layer is what the module states,
and routing is the BF16 layer's."""

import pytest
import torch
import torch.nn.functional as F

from fp4lab import formats, kernels
from fp4lab.nn.moe import MoE, MoEConfig
from fp4lab.nn.moe_infer import (compare_moe, expert_ffn, nvfp4_moe_forward, quantize_moe_weights,
                                 reference_nvfp4_moe_forward, route, stage_tokens)

CONFIGS = {"sigmoid+shared": dict(router="sigmoid", n_shared=1), "softmax": dict(router="softmax", n_shared=0)}


def make_moe(seed=0, dim=64, **cfg):
    torch.manual_seed(seed)
    moe = MoE(dim, MoEConfig(n_experts=8, top_k=2, expert_hidden=64, **{"n_shared": 1, **cfg}))
    moe.bias.copy_(0.05 * torch.randn(8))  # a trained layer's balancing bias: it steers the choice
    return moe


def tokens(t=96, dim=64, seed=1):
    return torch.randn(t, dim, generator=torch.Generator().manual_seed(seed))


def same_bytes(q, ref):
    return (torch.equal(q.codes, ref.codes) and torch.equal(q.scales.view(torch.uint8), ref.scales.view(torch.uint8))
            and q.tensor_scale.item() == ref.tensor_scale.item())


def test_weights_are_quantize_nvfp4_bytes():
    moe = make_moe()
    q = quantize_moe_weights(moe)
    ex = moe.experts
    for e in range(8):
        assert same_bytes(q.w13[e], formats.quantize_nvfp4(torch.cat([ex.w_gate[e], ex.w_up[e]]).detach()))
        assert same_bytes(q.w2[e], formats.quantize_nvfp4(ex.w_down[e].detach()))
    assert q.w13.tensor_scale.shape == (8,) and q.w13.codes.shape == (8, 128, 32)
    sh = moe.shared
    assert same_bytes(q.shared_w13[0], formats.quantize_nvfp4(torch.cat([sh.gate.weight, sh.up.weight]).detach()))
    assert same_bytes(q.shared_w2[0], formats.quantize_nvfp4(sh.down.weight.detach()))
    with pytest.raises(Exception):  # frozen
        q.w13 = None


def test_staged_activations_are_quantize_nvfp4_bytes():
    moe, x = make_moe(), tokens()
    d = stage_tokens(moe, x)
    by_hand = formats.quantize_nvfp4(x)
    assert same_bytes(d.q_x, by_hand)
    token_of_slot = torch.argsort(d.choice_TK.reshape(-1), stable=True) // 2
    assert torch.equal(d.q_sorted.codes, by_hand.codes[token_of_slot])
    assert torch.equal(d.q_sorted.scales.view(torch.uint8), by_hand.scales.view(torch.uint8)[token_of_slot])
    assert sum(d.counts) == 2 * x.shape[0]
    # the L2 operand: silu(gate) * up of the L1 GEMM, requantized by formats' quantizer
    qw = quantize_moe_weights(moe)
    rows = torch.arange(d.counts[0], d.counts[0] + d.counts[1])  # expert 1's slots
    q_in = formats.quantize_nvfp4(x[token_of_slot[rows]])
    y, q_a = expert_ffn(q_in, qw.w13[1], qw.w2[1], formats.scaled_mm)
    gate, up = formats.scaled_mm(q_in, qw.w13[1]).chunk(2, dim=-1)
    assert same_bytes(q_a, formats.quantize_nvfp4(F.silu(gate) * up))
    assert torch.equal(y, formats.scaled_mm(q_a, qw.w2[1]))


@pytest.mark.parametrize("mm", [formats.scaled_mm, kernels.fp4_mm], ids=["scaled_mm", "fp4_mm"])
@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_pipeline_matches_the_plain_reference(cfg, mm):
    """Equal to fp32 summation order (each GEMM), so no hidden code flips: 1e-6 relative."""
    moe, x = make_moe(**cfg), tokens()
    y = nvfp4_moe_forward(moe, quantize_moe_weights(moe), x, mm=mm)
    ref = reference_nvfp4_moe_forward(moe, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    rel = float((y.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-6 and float((y - ref).abs().max()) < 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_error_vs_the_fp32_layer_is_the_stated_fp4_error(cfg):
    moe = make_moe(seed=2, **cfg)
    stats = compare_moe(moe, tokens(t=256, seed=3))
    assert 0.15 < stats["rel_error"] < 0.3 and stats["cosine"] > 0.96
    assert stats["tokens"] == 256 and stats["min_token_cosine"] > 0.8


def test_compare_leaves_the_layer_as_it_was():
    moe = make_moe()
    moe.train()
    compare_moe(moe, tokens())
    assert moe.training and float(moe.load.sum()) == 0


def test_routing_is_the_bf16_layers():
    """Make the BF16 layer's experts output one-hot rows: y_TD[t, e] is then its routing weight."""
    for cfg in CONFIGS.values():
        moe, x = make_moe(**cfg), tokens()
        moe.shared = None

        def one_hot_experts(module, args, out):
            counts = args[1]  # counts_E, a tensor
            return F.one_hot(torch.repeat_interleave(torch.arange(8), counts), 64).float()
        handle = moe.experts.register_forward_hook(one_hot_experts)
        with torch.no_grad():
            dense_TE = moe.eval()(x)[:, :8]
        handle.remove()
        choice_TK, weight_TK = route(moe, x)
        mine_TE = torch.zeros(x.shape[0], 8).scatter(1, choice_TK, weight_TK)
        assert torch.equal(mine_TE, dense_TE)
        assert torch.equal(stage_tokens(moe, x).choice_TK, choice_TK)


def test_batched_input_and_bf16():
    moe, x = make_moe(), tokens(t=32)
    q = quantize_moe_weights(moe)
    y = nvfp4_moe_forward(moe, q, x.reshape(4, 8, 64))
    assert y.shape == (4, 8, 64) and torch.equal(y.reshape(32, 64), nvfp4_moe_forward(moe, q, x))


def test_bad_inputs():
    moe = make_moe()
    q = quantize_moe_weights(moe)
    with pytest.raises(ValueError, match=r"\[\.\.\., D = 64\]"):
        nvfp4_moe_forward(moe, q, torch.randn(4, 32))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        nvfp4_moe_forward(moe, q, torch.ones(4, 64, dtype=torch.int64))
    with pytest.raises(TypeError, match="MoE"):
        quantize_moe_weights(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="divisible by 16"):
        reference_nvfp4_moe_forward(MoE(24, MoEConfig(n_experts=4, top_k=1, expert_hidden=32)), torch.randn(2, 24))
    other = quantize_moe_weights(MoE(64, MoEConfig(n_experts=4, top_k=1, expert_hidden=32)))
    with pytest.raises(ValueError, match="4 experts"):
        nvfp4_moe_forward(moe, other, tokens())
