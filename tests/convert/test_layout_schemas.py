"""fp4lab convert's output against the layouts' documented schemas, written out here by hand
(sources in docs/checkpoints.md): compressed-tensors' nvfp4-pack-quantized config and tensors
(the NVFP4A16 preset scheme, initialize.py's global-scale shape), ModelOpt's hf_quant_config.json,
the config.json form vLLM's ModelOpt loader reads, and ModelOpt's tensor names."""

import fnmatch
import json
import re

import pytest
from safetensors import safe_open

from fp4lab.convert.checkpoint import convert_checkpoint

from .gpt_oss import EXPERTS, HIDDEN, LAYERS, MODULES_TO_NOT_CONVERT, gpt_oss_dir

EXPERT_MODULES = {"gate_up_proj": (96, HIDDEN), "down_proj": (HIDDEN, 64)}  # (out, in) of each expert

COMPRESSED_TENSORS_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": [r"re:^model\.layers\.\d+\.mlp\.experts\.down_proj$",
                    r"re:^model\.layers\.\d+\.mlp\.experts\.gate_up_proj$"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                    "symmetric": True, "dynamic": False},
        "input_activations": None,  # weight-only: MXFP4 gpt-oss runs BF16 activations
        "output_activations": None,
        "format": "nvfp4-pack-quantized"}},
    "ignore": ["lm_head", "model.embed_tokens", r"re:^model\.layers\.\d+\.mlp\.router$",
               r"re:^model\.layers\.\d+\.self_attn\.k_proj$", r"re:^model\.layers\.\d+\.self_attn\.o_proj$",
               r"re:^model\.layers\.\d+\.self_attn\.q_proj$", r"re:^model\.layers\.\d+\.self_attn\.v_proj$"],
    "kv_cache_scheme": None,
    "sparsity_config": {}}
MODELOPT_EXCLUDE = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.router", "model.layers.*.self_attn.k_proj",
                    "model.layers.*.self_attn.o_proj", "model.layers.*.self_attn.q_proj",
                    "model.layers.*.self_attn.v_proj"]
HF_QUANT_CONFIG = {"producer": {"name": "fp4lab", "version": "0.1.0"},
                   "quantization": {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                    "exclude_modules": MODELOPT_EXCLUDE}}
MODELOPT_CONFIG_JSON = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16,
                        "kv_cache_scheme": None, "ignore": MODELOPT_EXCLUDE,
                        "producer": {"name": "fp4lab", "version": "0.1.0"}}
# per quantized module: suffix -> (safetensors dtype, shape from the expert's (out, in))
TENSORS = {"modelopt": {"weight": ("U8", lambda o, i: [EXPERTS, o, i // 2]),
                        "weight_scale": ("F8_E4M3", lambda o, i: [EXPERTS, o, i // 16]),
                        "weight_scale_2": ("F32", lambda o, i: [])},
           "compressed-tensors": {"weight_packed": ("U8", lambda o, i: [EXPERTS, o, i // 2]),
                                  "weight_scale": ("F8_E4M3", lambda o, i: [EXPERTS, o, i // 16]),
                                  "weight_global_scale": ("F32", lambda o, i: [1])}}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("schema")
    src = gpt_oss_dir(root / "mx")
    for layout in TENSORS:
        convert_checkpoint(src, root / layout, layout=layout)
    return root


def _headers(root):
    out = {}
    for shard in root.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()})
    return out


def test_compressed_tensors_config(converted):
    config = json.loads((converted / "compressed-tensors" / "config.json").read_text())
    assert config["quantization_config"] == COMPRESSED_TENSORS_CONFIG
    assert not (converted / "compressed-tensors" / "hf_quant_config.json").exists()


def test_modelopt_configs(converted):
    assert json.loads((converted / "modelopt" / "hf_quant_config.json").read_text()) == HF_QUANT_CONFIG
    assert json.loads((converted / "modelopt" / "config.json").read_text())["quantization_config"] == \
        MODELOPT_CONFIG_JSON


@pytest.mark.parametrize("layout", list(TENSORS))
def test_tensor_names_dtypes_and_shapes(converted, layout):
    headers = _headers(converted / layout)
    expected = {}
    for layer in range(LAYERS):
        for module, (out, inp) in EXPERT_MODULES.items():
            for suffix, (dtype, shape) in TENSORS[layout].items():
                expected[f"model.layers.{layer}.mlp.experts.{module}.{suffix}"] = (dtype, shape(out, inp))
    assert {k: v for k, v in headers.items() if k in expected} == expected
    assert not any(k.endswith(("_blocks", "_scales")) for k in headers)
    assert headers["lm_head.weight"] == ("BF16", [50, HIDDEN])  # high precision, as it came


def _covered(name, patterns, regex):
    """Whether a module or one of its parents matches a pattern (a parent ignored: all of it)."""
    parts = name.split(".")
    heads = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    if regex:
        return any(re.match(p[3:], h) if p.startswith("re:") else p == h for p in patterns for h in heads)
    return any(fnmatch.fnmatchcase(h, p) for p in patterns for h in heads)


@pytest.mark.parametrize("layout", list(TENSORS))
def test_the_ignore_list_covers_what_gpt_oss_did_not_convert(converted, layout):
    """Every weight the input's modules_to_not_convert named stays ignored in the output's own syntax."""
    config = json.loads((converted / layout / "config.json").read_text())["quantization_config"]
    kept = [k.rpartition(".")[0] for k, (_, shape) in _headers(converted / layout).items()
            if k.endswith(".weight") and len(shape) == 2]
    named = [m for m in kept if _covered(m, MODULES_TO_NOT_CONVERT, regex=False)]
    assert len(named) == 2 + LAYERS * 5  # embed, lm_head; per layer q, k, v, o and the router
    assert all(_covered(m, config["ignore"], regex=layout == "compressed-tensors") for m in named)


def test_compressed_tensors_parses_its_config(converted):
    """Where compressed-tensors is installed: its own model of the config accepts ours, and our weights
    match its NVFP4A16 preset."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    config = json.loads((converted / "compressed-tensors" / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(config)
    assert parsed.quantization_status == "compressed" and parsed.format == "nvfp4-pack-quantized"
    preset = ct.preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    ours = parsed.config_groups["group_0"].weights
    for field in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic"):
        assert getattr(ours, field) == getattr(preset, field), field
