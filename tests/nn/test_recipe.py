"""Recipes: presets say what the papers say, round-trip through TOML/JSON, and reject typos."""

import dataclasses
import json
import re

import pytest

from fp4lab.formats import Format, MXScaleMode, Rounding
from fp4lab.nn.recipe import (GEMMS, NVIDIA_KEEP, PRESETS, Bf16Scope, GemmSpec, HadamardMode, Operand,
                              Recipe, bf16, fprop_dgrad, load_recipe, nvfp4, preset)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_round_trip_through_dict_json_and_toml(name, tmp_path):
    r = preset(name)
    assert Recipe.from_dict(r.to_dict()) == r
    assert Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    path = tmp_path / "r.toml"
    path.write_text(r.to_toml())
    assert load_recipe(path) == r


def test_the_nvidia_recipe_table():
    """docs/numerics.md "The NVIDIA training recipe": x RTNE 1x16, W RTNE 16x16, dy stochastic; RHT (TE signs, 16) on Wgrad only."""
    r = nvfp4()
    assert r.fprop.a == Operand(format="nvfp4") and r.fprop.b == Operand(format="nvfp4", block2d=True)
    assert r.dgrad.a == Operand(format="nvfp4", rounding="stochastic") and r.dgrad.b == r.fprop.b
    assert r.wgrad.a == r.dgrad.a and r.wgrad.b == r.fprop.a
    assert (r.wgrad.hadamard, r.wgrad.hadamard_size) == (HadamardMode.FIXED, 16)
    assert not r.fprop.rotated and not r.dgrad.rotated


def test_progression_and_mx_presets():
    assert [preset(n).quantized for n in ("bf16", "fprop")] == [False, True]
    r = fprop_dgrad()
    assert r.fprop.a.format is Format.MXFP4 and r.dgrad.b.format is Format.MXFP4
    assert not r.wgrad.quantized
    assert fprop_dgrad("nvfp4").fprop.a.format is Format.NVFP4
    assert preset("mxfp4_rceil").wgrad.a.mx_mode is MXScaleMode.RCEIL
    h = preset("mxfp4_hadamard").wgrad
    assert (h.hadamard, h.hadamard_size) == (HadamardMode.DETERMINISTIC, 32)


def test_override_with_dotted_keys_and_toml_base(tmp_path):
    r = nvfp4().override({"wgrad.hadamard": "random", "keep_last": 3, "wgrad.a.rounding": "rtne"})
    assert r.wgrad.hadamard is HadamardMode.RANDOM and r.keep_last == 3
    assert r.wgrad.a.rounding is Rounding.RTNE and r.dgrad.a.rounding is Rounding.STOCHASTIC
    path = tmp_path / "arm.toml"
    path.write_text('base = "nvfp4"\nkeep_first = 0\n[wgrad]\nhadamard = "none"\n')
    arm = load_recipe(path)
    assert arm.keep_first == 0 and not arm.wgrad.rotated and arm.fprop == nvfp4().fprop


@pytest.mark.parametrize("bad, match", [
    ({"fprop": {"a": {"formt": "nvfp4"}}}, r"unknown recipe key\(s\) \['fprop.a.formt'\]"),
    ({"keep_frist": 1}, "unknown recipe key"),
    ({"fprop": {"a": {"format": "fp8"}}}, "unknown Format"),
    ({"fprop": {"a": {"format": "nvfp4"}, "b": {"format": "mxfp4"}}}, "share a format"),
    ({"fprop": {"a": {"format": "mxfp4", "block2d": True}}}, "NVFP4 weight option"),
    ({"keep_fraction": [0.1]}, r"pair of fractions, got \[0.1\]"),
    ({"keep_fraction": [0.5, 0.5]}, r"sum below 1, got \[0.5, 0.5\]"),
    ({"keep_fraction": [-0.1, 0.2]}, r"\[0, 1\)"),
    ({"keep_fraction": [0.1, 0.2], "keep_last": 2}, "replaces keep_first / keep_last, got 0, 2"),
    ({"bf16_after": 1.5}, "fraction"),
    ({"fprop": {"hadamard_size": 64}}, "16 or 32"),
])
def test_bad_recipes_are_rejected_with_the_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        Recipe.from_dict(bad)


@pytest.mark.parametrize("bad, match", [
    ({"keep_fraction": 0.1}, "keep_fraction must be a list of float or none, got 0.1"),
    ({"keep_first": "zero"}, "keep_first must be int, got 'zero'"),
    ({"fprop": {"b": {"format": "nvfp4", "block2d": 3}}}, "fprop.b.block2d must be bool, got 3"),
    ({"wgrad": {"hadamard_size": 16.5}}, "wgrad.hadamard_size must be int, got 16.5"),
    ({"fprop": {"a": {"format": 4}}}, "fprop.a.format must be one of 'bf16', 'nvfp4', 'mxfp4', got 4"),
])
def test_wrong_types_name_the_dotted_key_and_the_type(bad, match):
    with pytest.raises(TypeError, match=re.escape(match)):
        Recipe.from_dict(bad)


def test_recipe_file_errors_name_the_file(tmp_path):
    syntax = tmp_path / "broken.toml"
    syntax.write_text("keep_first = \n")
    with pytest.raises(ValueError, match=f"recipe file {re.escape(str(syntax))}: not valid TOML: .*line 1"):
        load_recipe(syntax)
    typed = tmp_path / "typed.toml"
    typed.write_text('base = "nvfp4"\nkeep_first = "zero"\n')
    with pytest.raises(TypeError, match=f"recipe file {re.escape(str(typed))}: keep_first must be int, got 'zero'"):
        load_recipe(typed)
    nested = tmp_path / "nested.json"
    nested.write_text('{"fprop": {"a": {"format": "nvfp4", "rounding": "down"}}}')
    with pytest.raises(ValueError, match="nested.json: fprop.a: unknown Rounding 'down'"):
        load_recipe(nested)


def test_unknown_override_key_and_missing_file():
    with pytest.raises(ValueError, match="unknown recipe key"):
        nvfp4().override({"wgrad.hadamrd": "none"})
    with pytest.raises(FileNotFoundError, match="no preset"):
        load_recipe("nvfp5")


def test_dither_is_a_weight_option_only():
    w = Operand(format="nvfp4", dither=0.5)
    Recipe(fprop=GemmSpec(b=w), dgrad=GemmSpec(b=w))
    with pytest.raises(ValueError, match="weights only"):
        Recipe(fprop=GemmSpec(a=w))
    with pytest.raises(ValueError, match="one dithered weight"):
        Recipe(fprop=GemmSpec(b=w), dgrad=GemmSpec(b=Operand(format="nvfp4")))
    with pytest.raises(ValueError, match="rtne"):
        Operand(format="nvfp4", dither=0.5, rounding="stochastic")
    with pytest.raises(ValueError, match="has none"):  # a BF16 weight has no block scale to dither by
        Recipe(fprop=GemmSpec(b=Operand(dither=0.5)))


def test_bf16_after_switches_the_chosen_gemms():
    r = dataclasses.replace(nvfp4(), bf16_after=0.8)
    assert r.at_progress(0.5) is r
    late = r.at_progress(0.8)
    assert not any(late.gemm(g).quantized or late.gemm(g).rotated for g in GEMMS)
    fwd = dataclasses.replace(r, bf16_scope=Bf16Scope.FORWARD).at_progress(0.9)
    assert not fwd.fprop.quantized and fwd.dgrad == r.dgrad and fwd.wgrad == r.wgrad
    bwd = dataclasses.replace(r, bf16_scope="backward").at_progress(0.9)
    assert bwd.fprop == r.fprop and bwd.fprop.quantized
    assert not any(bwd.gemm(g).quantized or bwd.gemm(g).rotated for g in ("dgrad", "wgrad"))


def test_describe_names_every_gemm():
    text = nvfp4().describe()
    assert "fprop: x nvfp4/rtne  W nvfp4/rtne/16x16" in text and "hadamard fixed/16" in text


@pytest.mark.parametrize("n_blocks, want", [
    (0, (0, 0)), (1, (0, 0)), (2, (0, 0)), (3, (0, 0)), (4, (0, 1)), (6, (0, 1)), (8, (0, 1)), (12, (0, 2)),
    (16, (1, 2)), (24, (1, 3)), (32, (1, 4)), (48, (2, 6)), (62, (2, 8)),
])
def test_nvidia_fractions_resolve_against_depth_as_documented(n_blocks, want):
    assert nvfp4().keep_fraction == NVIDIA_KEEP == (2 / 62, 8 / 62)
    assert nvfp4().bf16_blocks(n_blocks) == want


def test_bf16_blocks_clamps_and_never_keeps_every_block_of_a_fraction():
    assert Recipe(keep_fraction=(0.9, 0.05)).bf16_blocks(2) == (1, 0)  # rounds to 2 of 2: one stays FP4
    assert Recipe(keep_fraction=(0.0, 0.5)).bf16_blocks(3) == (0, 2)  # 1.5 rounds half up
    assert nvfp4(keep_first=1, keep_last=1).bf16_blocks(6) == (1, 1)
    assert nvfp4(keep_first=1, keep_last=1).bf16_blocks(1) == (1, 0)  # counts: each block once
    assert nvfp4(keep_first=3, keep_last=3).bf16_blocks(4) == (3, 1)
    with pytest.raises(ValueError, match="n_blocks must be >= 0, got -1"):
        nvfp4().bf16_blocks(-1)


def test_nvfp4_counts_replace_the_fractions():
    r = nvfp4(keep_last=2)
    assert (r.keep_fraction, r.keep_first, r.keep_last) == (None, 0, 2)
    with pytest.raises(ValueError, match="set one or the other"):
        dataclasses.replace(nvfp4(), keep_first=1)


def test_overrides_switch_between_counts_and_fractions(tmp_path):
    counts = nvfp4().override({"keep_first": 0, "keep_last": 0})  # the CPU demo's and the ablation's override
    assert counts.keep_fraction is None and counts.bf16_blocks(62) == (0, 0)
    assert nvfp4().override({"keep_last": 3}).bf16_blocks(62) == (0, 3)
    frac = nvfp4(keep_first=1, keep_last=1).override({"keep_fraction": [0.1, 0.2]})
    assert (frac.keep_fraction, frac.keep_first, frac.keep_last) == ((0.1, 0.2), 0, 0)
    assert frac.bf16_blocks(10) == (1, 2)
    assert nvfp4().override({"keep_fraction": None}).bf16_blocks(62) == (0, 0)
    with pytest.raises(ValueError, match="set one or the other"):
        nvfp4().override({"keep_fraction": [0.1, 0.2], "keep_first": 1})
    path = tmp_path / "arm.toml"
    path.write_text('base = "nvfp4"\nkeep_fraction = [0.25, 0.25]\n')
    assert load_recipe(path).bf16_blocks(8) == (2, 2)
    path.write_text(frac.to_toml())
    assert load_recipe(path) == frac and "keep_fraction = [0.1, 0.2]" in frac.to_toml()


def test_gains_are_allowed_on_every_recipe_and_round_trip(tmp_path):
    """The gains change training, not quantization: a BF16 control arm must be able to take them."""
    for base in (bf16(), preset("mxfp4"), nvfp4()):
        r = base.override({"embed_gain": 10.667, "logits_gain": 0.125})
        assert (r.embed_gain, r.logits_gain) == (10.667, 0.125)
        assert Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
        path = tmp_path / "r.toml"
        path.write_text(r.to_toml())
        assert load_recipe(path) == r


def test_a_recipe_rule_is_worked_out_once_per_recipe_object():
    from fp4lab.nn.recipe import recipe_rule
    asked = []

    @recipe_rule
    def rule(recipe, gemm):
        asked.append((id(recipe), gemm))
        return recipe.gemm(gemm).a.quantized
    a, b = preset("nvfp4"), preset("nvfp4")  # equal, distinct objects
    assert a == b and a is not b
    assert [rule(a, "fprop"), rule(a, "fprop"), rule(b, "fprop"), rule(a, "wgrad")] == [True] * 4
    assert asked == [(id(a), "fprop"), (id(b), "fprop"), (id(a), "wgrad")]  # once per (object, keys)
    for i in range(600):  # recipes made per call (at_progress after bf16_after): the memo stays bounded
        rule(a.override({"seed": i}), "fprop")
    assert rule(a, "fprop") is True
