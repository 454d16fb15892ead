"""Diagnostics: operand statistics per GEMM, code-flip rate (stiction), and dither."""

import pytest
import torch

from fp4lab.nn import GPT, QuantContext, StictionMeter, fprop_weight, model_config, operand_stats, quantize_model
from fp4lab.nn.diagnostics import code_flip_rate, weight_codes
from fp4lab.nn.recipe import GemmSpec, Operand, Recipe, nvfp4


def test_operand_stats_cover_every_quantized_operand():
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=64, seq_len=32))
    quantize_model(model, nvfp4(keep_first=0, keep_last=0))
    idx = torch.randint(0, 64, (2, 32))
    stats = operand_stats(model, lambda: model(idx, idx).backward())
    layers = {n.rsplit(".", 2)[0] for n in stats}
    assert len(layers) == 2 * 5 and len(stats) == 6 * len(layers)
    for key, s in stats.items():
        assert 5 < s["sqnr_db"] < 40 and 0 <= s["flushed_blocks"] < 0.5 and 0 <= s["saturated"] < 0.05, (key, s)
    assert not model.fp4_context.collect
    with pytest.raises(ValueError, match="quantize_model"):
        operand_stats(GPT(model_config("tiny", vocab_size=64, seq_len=32)), lambda: None)


def _weight_recipe(dither=0.0):
    w = Operand(format="nvfp4", block2d=True, dither=dither)
    return Recipe(fprop=GemmSpec(a=Operand(format="nvfp4"), b=w), dgrad=GemmSpec(b=w))


def test_dither_zero_is_rtne_and_dither_is_seeded_per_step():
    w = torch.randn(64, 64) * 0.02
    rtne = fprop_weight(w, _weight_recipe(), name="l", context=QuantContext(tick=3))
    d0 = fprop_weight(w, _weight_recipe(0.0), name="l", context=QuantContext(tick=9))
    assert torch.equal(rtne.codes, d0.codes)
    a = fprop_weight(w, _weight_recipe(1.0), name="l", context=QuantContext(tick=3))
    b = fprop_weight(w, _weight_recipe(1.0), name="l", context=QuantContext(tick=3))
    c = fprop_weight(w, _weight_recipe(1.0), name="l", context=QuantContext(tick=4))
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)
    assert not torch.equal(a.codes, rtne.codes)


def test_small_updates_stick_under_rtne_and_move_under_dither():
    """An update far below half a code step: RTNE codes do not move; dithered codes do."""
    rates = {}
    for dither in (0.0, 1.0):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
        context = quantize_model(model, _weight_recipe(dither))
        meter = StictionMeter(model)
        meter.before()
        with torch.no_grad():
            model[0].weight.mul_(1 + 1e-4)
        context.tick += 1
        rates[dither] = meter.after()["all"]
    assert rates[0.0] < 0.002 and rates[1.0] > 0.05, rates


def test_code_flip_rate_counts_changed_codes():
    old = {"a": torch.zeros(4, 8, dtype=torch.uint8), "b": torch.zeros(2, 2, dtype=torch.uint8)}
    new = {"a": old["a"].clone(), "b": torch.ones(2, 2, dtype=torch.uint8)}
    new["a"][0, :4] = 3
    rates = code_flip_rate(old, new)
    assert rates == {"a": 4 / 32, "b": 1.0, "all": 8 / 36}
    with pytest.raises(ValueError, match="different weights"):
        code_flip_rate(old, {"a": old["a"]})


def test_weight_codes_include_each_expert():
    torch.manual_seed(2)
    model = GPT(model_config("moe-tiny", vocab_size=64, seq_len=32))
    quantize_model(model, nvfp4(keep_first=0, keep_last=0))
    names = weight_codes(model)
    assert "blocks.1.ffn.experts.7.down" in names and "blocks.0.attn.qkv" in names
    assert names["blocks.1.ffn.experts.0.gate"].shape == (64, 128)
