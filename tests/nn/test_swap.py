"""nn.swap: BF16 blocks follow the model's depth, coverage is recorded, gains apply on any recipe."""

import dataclasses

import pytest
import torch

from fp4lab.nn import GPT, fp4_modules, model_config, quantize_model
from fp4lab.nn.recipe import Recipe, bf16, load_recipe, nvfp4
from fp4lab.nn.swap import coverage

LINEARS = ("attn.qkv", "attn.proj", "ffn.gate", "ffn.up", "ffn.down")


def _tiny(depth=2, name="tiny", seed=0):
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(model_config(name, vocab_size=64), depth=depth))


def _batch(seed=0, b=2, t=16):
    idx = torch.randint(0, 64, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return idx[:, :-1], idx[:, 1:]


def _linear_weights(model, keep=lambda name: True):
    return sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and keep(n))


def test_nvfp4_keeps_the_resolved_blocks_and_records_its_coverage():
    model = _tiny(depth=8)
    quantize_model(model, nvfp4())  # NVIDIA's fractions at depth 8: no first block, the last one
    assert set(fp4_modules(model)) == {f"blocks.{i}.{m}" for i in range(7) for m in LINEARS}
    fp4 = _linear_weights(model, lambda n: n.startswith("blocks.") and not n.startswith("blocks.7."))
    split = {"bf16": 1 - fp4 / _linear_weights(model), "nvfp4": fp4 / _linear_weights(model)}
    want = {"blocks": 8, "bf16_first": 0, "bf16_last": 1, "linears": {"fp4": 35, "bf16": 6},
            "fp4_param_fraction": fp4 / _linear_weights(model),
            "flop_fraction": {"fprop": split, "dgrad": split, "wgrad": split}}  # dense: FLOPs go with weights
    assert model.fp4_coverage == coverage(model) == want


def test_coverage_of_a_plain_model_and_of_a_bf16_recipe():
    plain = _tiny()
    all_bf16 = {gemm: {"bf16": 1.0} for gemm in ("fprop", "dgrad", "wgrad")}
    assert coverage(plain) == {"blocks": 2, "bf16_first": None, "bf16_last": None,
                               "linears": {"fp4": 0, "bf16": 11}, "fp4_param_fraction": 0.0,
                               "flop_fraction": all_bf16}
    quantize_model(plain, bf16().override({"keep_bf16": []}))  # swaps nothing: BF16 as users run it
    assert not fp4_modules(plain)
    assert plain.fp4_coverage == {"blocks": 2, "bf16_first": 0, "bf16_last": 0,
                                  "linears": {"fp4": 0, "bf16": 11}, "fp4_param_fraction": 0.0,
                                  "flop_fraction": all_bf16}


def test_coverage_counts_expert_weights():
    model = _tiny(name="moe-tiny")
    quantize_model(model, nvfp4(keep_first=0, keep_last=0))
    experts = model.blocks[1].ffn.experts
    expert_weights = sum(p.numel() for p in experts.parameters())
    fp4 = _linear_weights(model, lambda n: n.startswith("blocks.") and "router" not in n) + expert_weights
    total = _linear_weights(model) + expert_weights
    cov = model.fp4_coverage
    # block 0 dense (5), block 1: attention (2), shared SwiGLU (3), experts (1); BF16: router, lm_head
    assert cov["linears"] == {"fp4": 11, "bf16": 2} and (cov["bf16_first"], cov["bf16_last"]) == (0, 0)
    assert cov["fp4_param_fraction"] == pytest.approx(fp4 / total)
    # FLOPs: each token meets top_k of the n_experts experts, and every dense linear once
    moe = model.blocks[1].ffn
    routed = expert_weights * moe.cfg.top_k / moe.cfg.n_experts
    flop_fp4 = (fp4 - expert_weights + routed) / (total - expert_weights + routed)
    assert cov["flop_fraction"]["wgrad"] == pytest.approx({"bf16": 1 - flop_fp4, "nvfp4": flop_fp4})


def test_flop_fraction_follows_each_gemm_of_the_recipe():
    from fp4lab.nn.recipe import preset
    model = _tiny(depth=2)
    quantize_model(model, preset("fprop").override({"keep_bf16": ["lm_head"]}))  # MXFP4 forward only
    fp4 = _linear_weights(model, lambda n: n.startswith("blocks."))
    flops = model.fp4_coverage["flop_fraction"]
    share = fp4 / _linear_weights(model)
    assert flops["fprop"] == pytest.approx({"bf16": 1 - share, "mxfp4": share})
    assert flops["dgrad"] == flops["wgrad"] == {"bf16": 1.0}


def test_a_bf16_recipe_with_an_embedding_gain_trains_with_it(tmp_path):
    """Issue 19: the gain is a training change, so a BF16 control arm must be able to carry it."""
    recipe = bf16().override({"embed_gain": 10.667})
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    path = tmp_path / "bf16_gain.toml"
    path.write_text(recipe.to_toml())
    assert load_recipe(path) == recipe
    unit, gained = _tiny(), _tiny()
    quantize_model(unit, bf16())
    quantize_model(gained, recipe)
    assert (gained.embed_gain, gained.logits_gain) == (10.667, 1.0)
    assert gained.fp4_coverage["fp4_param_fraction"] == 0.0
    idx, tgt = _batch()
    assert not torch.allclose(unit(idx), gained(idx))
    torch.testing.assert_close(gained(idx), _forward_with_scaled_embeddings(unit, idx, 10.667))
    opt = torch.optim.AdamW(gained.parameters(), lr=1e-2)
    loss = gained(idx, tgt)
    loss.backward()
    assert gained.wte.weight.grad.abs().sum() > 0
    opt.step()
    assert torch.isfinite(gained(idx, tgt)) and not torch.equal(gained.wte.weight, unit.wte.weight)


def _forward_with_scaled_embeddings(model, idx, gain):
    """The unit-gain model with its embedding table scaled: what embed_gain must compute."""
    with torch.no_grad():
        model.wte.weight.mul_(gain)
        out = model(idx)
        model.wte.weight.div_(gain)
    return out


def test_a_recipe_that_quantizes_no_linear_is_refused():
    with pytest.raises(ValueError, match=r"quantizes no linear of this model: its BF16 blocks \(first 1, last 1 of 2\)"):
        quantize_model(_tiny(depth=2), nvfp4(keep_first=1, keep_last=1))
    quantize_model(_tiny(depth=2), bf16())  # a BF16 recipe quantizes nothing by design
    assert coverage(_quantized := _tiny(depth=2)) and quantize_model(_quantized, nvfp4(keep_first=1, keep_last=0))
