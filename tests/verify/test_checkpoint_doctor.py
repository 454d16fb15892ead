"""The checkpoint doctor: a clean W4A4 checkpoint of each layout passes, and each planted fault is
named. The fixtures are written here, by hand, from the layouts' documented schemas (tensor names,
dtypes, shapes, config fields: docs/checkpoints.md), with fp4lab's quantizer for the numbers but
not fp4lab's checkpoint writer."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4lab.convert.checkpoint import convert_checkpoint
from fp4lab.formats import quantize_mxfp4, quantize_nvfp4, swizzle_scales
from fp4lab.verify import cli
from fp4lab.verify.checkpoint import check_checkpoint

ATTN, MLP = "model.layers.0.self_attn", "model.layers.0.mlp"
EXPERT = "model.layers.1.mlp.experts"
ROUTER = "model.layers.1.mlp.gate"  # the Mixtral / Qwen-MoE router name
FUSED = [[f"{ATTN}.{p}_proj" for p in "qkv"], [f"{MLP}.gate_proj", f"{MLP}.up_proj"],
         *[[f"{EXPERT}.{e}.gate_proj", f"{EXPERT}.{e}.up_proj"] for e in range(2)]]
ALONE = [f"{ATTN}.o_proj", f"{MLP}.down_proj", *[f"{EXPERT}.{e}.down_proj" for e in range(2)]]
# names and conventions as documented: (codes, block scales, weight global, input global, global shape, encode)
LAYOUTS = {"modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale", [], False),
           "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", [1],
                                  True)}
CONFIGS = {
    "modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_scheme": None,
                 "ignore": ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"]},
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                  "symmetric": True, "dynamic": "local"}}},
        "ignore": ["lm_head", "re:.*mlp\\.gate$"]}}
HF_QUANT_CONFIG = {"producer": {"name": "modelopt", "version": "0.39.0"},
                   "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                    "exclude_modules": ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"]}}


def _nvfp4(tensors, m, w, layout, amax=None, input_amax=10.0):
    codes, scales, glob, inp, shape, encode = LAYOUTS[layout]
    q = quantize_nvfp4(w, global_amax=amax)
    s_dec = q.tensor_scale.float()
    tensors[f"{m}.{codes}"], tensors[f"{m}.{scales}"] = q.codes, q.scales
    tensors[f"{m}.{glob}"] = (1 / s_dec if encode else s_dec).reshape(shape)
    x_dec = torch.tensor(input_amax / 2688.0)
    tensors[f"{m}.{inp}"] = (1 / x_dec if encode else x_dec).reshape(shape)


def write_w4a4(root, layout):
    """A W4A4 NVFP4 checkpoint: dense attention and MLP, two per-expert MoE experts, a router,
    embeddings and lm_head in BF16; fused projections share their global scale."""
    g = torch.Generator().manual_seed(0)
    root.mkdir()
    t = {"model.embed_tokens.weight": torch.randn(50, 64, generator=g).bfloat16(),
         "lm_head.weight": torch.randn(50, 64, generator=g).bfloat16(),
         f"{ROUTER}.weight": torch.randn(2, 64, generator=g).bfloat16(), "model.norm.weight": torch.ones(64)}
    for group in FUSED:
        ws = [torch.randn(64, 64, generator=g) * 0.02 for _ in group]
        amax = max(float(w.abs().max()) for w in ws)
        for m, w in zip(group, ws):
            _nvfp4(t, m, w, layout, amax=amax)
    for m in ALONE:
        _nvfp4(t, m, torch.randn(64, 64, generator=g) * 0.02, layout)
    save_file(t, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", "quantization_config": CONFIGS[layout]}))
    if layout == "modelopt":
        (root / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG))
    return root


def edit(root, fn):
    tensors = load_file(str(root / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(root / "model.safetensors"))


def edit_config(root, fn, name="config.json"):
    value = json.loads((root / name).read_text())
    fn(value)
    (root / name).write_text(json.dumps(value))


def named(findings, code, where=None):
    return any(f.code == code and (where is None or f.where == where) for f in findings)


@pytest.fixture(params=["modelopt", "compressed-tensors"])
def ckpt(request, tmp_path):
    layout = request.param
    return write_w4a4(tmp_path / layout, layout), LAYOUTS[layout]


def test_a_clean_checkpoint_of_each_layout_passes(ckpt):
    assert check_checkpoint(ckpt[0]) == []


def test_missing_and_zero_per_expert_input_scales_are_named(ckpt):
    root, (_, _, _, inp, _, _) = ckpt
    edit(root, lambda t: (t.pop(f"{EXPERT}.1.down_proj.{inp}"), t[f"{EXPERT}.0.gate_proj.{inp}"].zero_()))
    findings = check_checkpoint(root)
    assert named(findings, "missing-input-scale", f"{EXPERT}.1.down_proj.{inp}")
    assert named(findings, "global-scale-not-positive", f"{EXPERT}.0.gate_proj.{inp}")


@pytest.mark.parametrize("value, code", [(float("nan"), "global-scale-not-finite"),
                                         (float("inf"), "global-scale-not-finite"),
                                         (0.0, "global-scale-not-positive"), (-1e-3, "global-scale-not-positive")])
def test_bad_global_scales_are_named(ckpt, value, code):
    root, (_, _, glob, _, _, _) = ckpt
    edit(root, lambda t: t[f"{ATTN}.o_proj.{glob}"].fill_(value))
    assert named(check_checkpoint(root), code, f"{ATTN}.o_proj.{glob}")


def test_a_global_scale_in_the_other_layouts_convention_is_named(ckpt):
    root, (_, _, glob, _, _, _) = ckpt
    edit(root, lambda t: t.__setitem__(f"{MLP}.down_proj.{glob}", 1 / t[f"{MLP}.down_proj.{glob}"]))
    findings = check_checkpoint(root)
    assert named(findings, "global-scale-convention", f"{MLP}.down_proj.{glob}")
    assert not named(findings, "global-scale-convention", f"{ATTN}.o_proj.{glob}")  # only the planted one


def test_fused_projections_with_different_global_scales_are_named(ckpt):
    root, (_, _, glob, _, _, _) = ckpt
    edit(root, lambda t: t[f"{ATTN}.k_proj.{glob}"].mul_(2))
    edit(root, lambda t: t[f"{EXPERT}.1.up_proj.{glob}"].mul_(0.5))
    findings = check_checkpoint(root)
    assert named(findings, "fused-global-scale", ATTN) and named(findings, "fused-global-scale", f"{EXPERT}.1")
    assert not named(findings, "fused-global-scale", MLP)


def test_a_fused_group_quantized_in_part_is_named(ckpt):
    root, (codes, scales, glob, inp, _, _) = ckpt

    def keep_k_in_bf16(t):
        for leaf in (codes, scales, glob, inp):
            t.pop(f"{ATTN}.k_proj.{leaf}")
        t[f"{ATTN}.k_proj.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)
    edit(root, keep_k_in_bf16)
    findings = check_checkpoint(root)
    assert named(findings, "fused-partly-quantized", ATTN)
    assert not named(findings, "fused-partly-quantized", MLP)


def test_a_quantized_router_and_lm_head_are_named(ckpt, tmp_path):
    root, layout = ckpt
    name = "modelopt" if layout[0] == "weight" else "compressed-tensors"

    def quantize(t):
        for m in (ROUTER, "lm_head"):
            w = t.pop(f"{m}.weight").float()
            _nvfp4(t, m, w, name)
    edit(root, quantize)
    findings = check_checkpoint(root)
    assert named(findings, "quantized-router", ROUTER) and named(findings, "quantized-lm-head", "lm_head")
    assert named(findings, "ignored-but-quantized", ROUTER)  # the config still says it is not


def test_swizzled_scales_are_named_by_their_padded_shape(ckpt):
    root, (_, scales, _, _, _, _) = ckpt
    edit(root, lambda t: t.__setitem__(f"{ATTN}.q_proj.{scales}", swizzle_scales(t[f"{ATTN}.q_proj.{scales}"])))
    assert named(check_checkpoint(root), "scales-swizzled", f"{ATTN}.q_proj.{scales}")


def test_config_faults_are_named(ckpt):
    root, layout = ckpt
    edit_config(root, lambda c: c["quantization_config"]["ignore"].remove("lm_head"))
    findings = check_checkpoint(root)
    assert named(findings, "not-ignored", "lm_head")
    if layout[0] == "weight":  # ModelOpt: the two config files disagree now
        assert named(findings, "config-mismatch")
    else:
        edit_config(root, lambda c: c["quantization_config"].pop("quantization_status"))
        assert named(check_checkpoint(root), "config-field")
    edit_config(root, lambda c: c.__setitem__("quantization_config", {"quant_method": "mxfp4"}))
    assert named(check_checkpoint(root), "config-layout", "config.json")


def test_the_old_modelopt_config_is_named(tmp_path):
    root = write_w4a4(tmp_path / "m", "modelopt")
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    edit_config(root, lambda c: c.__setitem__("quantization", {"quant_algo": "NVFP4", "group_size": 16,
                                                                "quantized_tensors": [f"{ATTN}.q_proj"]}),
                "hf_quant_config.json")
    findings = check_checkpoint(root)
    assert named(findings, "config-field", "hf_quant_config.json") and named(findings, "config-missing", "config.json")
    assert named(findings, "not-ignored", ROUTER)


def test_tensors_of_the_other_layout_and_unconverted_pairs_are_named(ckpt):
    root, (_, _, glob, _, _, _) = ckpt
    other = "weight_global_scale" if glob == "weight_scale_2" else "weight_scale_2"

    def plant(t):
        t[f"{ATTN}.o_proj.{other}"] = torch.ones(())
        t["model.layers.2.mlp.experts.down_proj_blocks"] = torch.zeros(2, 4, 2, 16, dtype=torch.uint8)
        t["model.layers.2.mlp.experts.down_proj_scales"] = torch.zeros(2, 4, 2, dtype=torch.uint8)
    edit(root, plant)
    findings = check_checkpoint(root)
    assert named(findings, "other-layout", f"{ATTN}.o_proj.{other}")
    assert named(findings, "unconverted-mxfp4", "model.layers.2.mlp.experts.down_proj")


def _mx_source(path):
    g = torch.Generator().manual_seed(1)
    q = quantize_mxfp4(torch.randn(2, 128, 64, generator=g) * 0.02, mode="rceil")
    save_file({"model.layers.0.mlp.experts.down_proj_blocks": q.codes.reshape(2, 128, 2, 16),
               "model.layers.0.mlp.experts.down_proj_scales": q.scales}, str(path))
    return path


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_swapped_nibbles_and_same_shape_swizzled_scales_are_named_against_the_source(tmp_path, layout):
    src, dst = _mx_source(tmp_path / "mx.safetensors"), tmp_path / "nv"
    convert_checkpoint(src, dst, layout=layout)
    codes, scales = LAYOUTS[layout][:2]
    m = "model.layers.0.mlp.experts.down_proj"
    assert check_checkpoint(dst, reference=src) == []

    shard = dst / "mx.safetensors"
    original = load_file(str(shard))
    c = original[f"{m}.{codes}"]
    save_file({**original, f"{m}.{codes}": (c << 4) | (c >> 4)}, str(shard))
    assert named(check_checkpoint(dst, reference=src), "nibbles-swapped", f"{m}.{codes}")
    tensors = dict(original)  # [2, 128, 4]: the swizzled bytes fit the linear shape exactly
    s = tensors[f"{m}.{scales}"]
    tensors[f"{m}.{scales}"] = torch.stack([swizzle_scales(e) for e in s]).reshape(s.shape)
    save_file(tensors, str(shard))
    findings = check_checkpoint(dst, reference=src)
    assert named(findings, "scales-swizzled", f"{m}.{scales}") and not named(findings, "nibbles-swapped")


def test_index_faults_and_the_cli(tmp_path, capsys):
    root = write_w4a4(tmp_path / "m", "modelopt")
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "other.safetensors"}}))
    parser = cli.argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    assert cli.run(parser.parse_args(["verify", "checkpoint", str(root), "--json"])) == 1
    findings = json.loads(capsys.readouterr().out)
    assert {"level": "error", "code": "index", "where": "lm_head.weight",
            "message": "listed in model.safetensors.index.json under other.safetensors, which does not hold it"} \
        in findings
    (root / "model.safetensors.index.json").unlink()
    assert cli.run(parser.parse_args(["verify", "checkpoint", str(root)])) == 0
    assert capsys.readouterr().out.strip().endswith("PASS (0 errors, 0 warnings)")
