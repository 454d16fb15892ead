"""Published FP4 checkpoints: PTQ of a Hugging Face-style directory, reading both NVFP4 layouts
and gpt-oss MXFP4 back, writing again; bit-identical round trips; bad input refused."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp4lab.convert.checkpoint import convert_checkpoint
from fp4lab.convert.mxfp4_to_nvfp4 import mxfp4_to_nvfp4
from fp4lab.convert.stream import mx_tensor
from fp4lab.formats import dequantize, quantize_nvfp4
from fp4lab.hub import MXFP4, read_checkpoint, quantize_model_dir, write_checkpoint
from fp4lab.verify.checkpoint import check_checkpoint

from ..convert.gpt_oss import gpt_oss_dir

LAYOUTS = ["modelopt", "compressed-tensors"]
# the layouts' documented schemas (docs/checkpoints.md): suffix -> (dtype, shape of the global)
SCHEMA = {"modelopt": {"weight": "U8", "weight_scale": "F8_E4M3", "weight_scale_2": ("F32", [])},
          "compressed-tensors": {"weight_packed": "U8", "weight_scale": "F8_E4M3",
                                 "weight_global_scale": ("F32", [1])}}


def llama_dir(root, *, layers=2, d=64, f=128, vocab=96, seed=0):
    """A Llama-style model directory with random weights, named as transformers names them."""
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(vocab, d, generator=g), "model.norm.weight": torch.ones(d),
         "lm_head.weight": torch.randn(vocab, d, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (d, d)), ("self_attn.k_proj", (d // 2, d)),
                            ("self_attn.v_proj", (d // 2, d)), ("self_attn.o_proj", (d, d)),
                            ("mlp.gate_proj", (f, d)), ("mlp.up_proj", (f, d)), ("mlp.down_proj", (d, f))):
            scale = 3.0 if name.endswith("v_proj") else 0.5  # fused members with different amaxes
            t[p + name + ".weight"] = torch.randn(*shape, generator=g) * scale
        t[p + "input_layernorm.weight"] = torch.ones(d)
    t = {k: v.to(torch.bfloat16) for k, v in t.items()}
    root.mkdir(parents=True)
    save_file(t, str(root / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
              "intermediate_size": f, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": vocab, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text('{"model": "test"}')
    return root, t


def _headers(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}


def _tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.element_size() == 1
                                                                      else a, b.view(torch.uint8)
                                                                      if b.element_size() == 1 else b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ptq_writes_the_documented_schema_and_the_doctor_passes(tmp_path, layout):
    src, t = llama_dir(tmp_path / "hf")
    quantize_model_dir(src, tmp_path / "nv", layout=layout)
    assert check_checkpoint(tmp_path / "nv") == []
    headers = _headers(tmp_path / "nv" / "model.safetensors")
    codes, scales, glob = SCHEMA[layout]
    m = "model.layers.1.mlp.down_proj"
    assert headers[f"{m}.{codes}"] == ("U8", [64, 64])
    assert headers[f"{m}.{scales}"] == ("F8_E4M3", [64, 8])
    assert headers[f"{m}.{glob}"] == SCHEMA[layout][glob]
    # embeddings, lm_head and norms stay as they were; the config ignores lm_head
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert headers[name] == ("BF16", list(t[name].shape))
    config = json.loads((tmp_path / "nv" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == layout and config["model_type"] == "llama"
    assert (tmp_path / "nv" / "tokenizer.json").read_text() == '{"model": "test"}'


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_gives_back_exactly_what_ptq_quantized(tmp_path, layout):
    src, t = llama_dir(tmp_path / "hf")
    written = quantize_model_dir(src, tmp_path / "nv", layout=layout)
    ckpt = read_checkpoint(tmp_path / "nv")
    assert ckpt.layout == layout and sorted(ckpt.weights) == sorted(written.weights) and not ckpt.w4a4
    assert len(ckpt.weights) == 14
    for m, q in ckpt.weights.items():
        w = written.weights[m]
        assert torch.equal(q.codes, w.codes) and _same_bits(q.scales, w.scales)
        if layout == "modelopt":  # the decode multiplier is stored as is
            assert torch.equal(q.tensor_scale, w.tensor_scale)
        else:  # stored as its fp32 reciprocal, read back as fp32(1 / g): within one ulp
            assert torch.allclose(q.tensor_scale, w.tensor_scale, rtol=2 ** -23, atol=0)
    # the fused projections share one global scale, from the amax of all three
    qkv = [ckpt.weights[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"]
    assert qkv[0].tensor_scale == qkv[1].tensor_scale == qkv[2].tensor_scale
    amax = max(float(t[f"model.layers.0.self_attn.{p}_proj.weight"].float().abs().max()) for p in "qkv")
    q_ref = quantize_nvfp4(t["model.layers.0.self_attn.q_proj.weight"].float(), global_amax=amax)
    assert torch.equal(qkv[0].codes, q_ref.codes) and torch.equal(written.weights[qkv_name(0)].tensor_scale,
                                                                   q_ref.tensor_scale)
    assert set(ckpt.dense) == {k for k in t if "layernorm" in k or k.startswith(("model.embed", "model.norm", "lm"))}
    # dequantized weights are close to the originals (NVFP4's error, not a wrong convention)
    w = t["model.layers.1.mlp.up_proj.weight"].float()
    err = (dequantize(ckpt.weights["model.layers.1.mlp.up_proj"]) - w).norm() / w.norm()
    assert 0.05 < float(err) < 0.15


def qkv_name(i):
    return f"model.layers.{i}.self_attn.q_proj"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_then_write_reproduces_every_tensor_bit_for_bit(tmp_path, layout):
    src, _ = llama_dir(tmp_path / "hf")
    quantize_model_dir(src, tmp_path / "a", layout=layout)
    write_checkpoint(read_checkpoint(tmp_path / "a"), tmp_path / "b")
    a, b = _tensors(tmp_path / "a" / "model.safetensors"), _tensors(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    for name in ("config.json", "tokenizer.json") + (("hf_quant_config.json",) if layout == "modelopt" else ()):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_a_layout_change_keeps_codes_and_scales_and_flips_the_global_convention(tmp_path):
    src, _ = llama_dir(tmp_path / "hf")
    quantize_model_dir(src, tmp_path / "mo", layout="modelopt")
    write_checkpoint(read_checkpoint(tmp_path / "mo"), tmp_path / "ct", layout="compressed-tensors")
    assert check_checkpoint(tmp_path / "ct") == []
    mo, ct = _tensors(tmp_path / "mo" / "model.safetensors"), _tensors(tmp_path / "ct" / "model.safetensors")
    m = "model.layers.0.mlp.gate_proj"
    assert torch.equal(mo[f"{m}.weight"], ct[f"{m}.weight_packed"])
    assert _same_bits(mo[f"{m}.weight_scale"], ct[f"{m}.weight_scale"])
    assert torch.equal(ct[f"{m}.weight_global_scale"], torch.reciprocal(mo[f"{m}.weight_scale_2"]).reshape(1))


def test_mxfp4_reads_as_stored_and_its_conversion_reads_back_bit_identical(tmp_path):
    src = gpt_oss_dir(tmp_path / "mx")
    mx = read_checkpoint(src)
    assert mx.layout == MXFP4 and mx.weights
    seen = set()
    for shard in src.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for base in {k[:-7] for k in f.keys() if k.endswith("_blocks")}:
                ref, q = mx_tensor(f, base), mx.weights[base]
                assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
                seen.add(base)
    assert seen == set(mx.weights)
    assert not any(k.endswith(("_blocks", "_scales")) for k in mx.dense)
    for layout in LAYOUTS:
        convert_checkpoint(src, tmp_path / layout, layout=layout)
        nv = read_checkpoint(tmp_path / layout)
        assert sorted(nv.weights) == sorted(mx.weights)
        for base, q in nv.weights.items():
            expected, _ = mxfp4_to_nvfp4(mx.weights[base], "best")
            assert torch.equal(q.codes, expected.codes) and _same_bits(q.scales, expected.scales)
            stored = 1 / nv.stored_globals[base] if layout == "compressed-tensors" else nv.stored_globals[base]
            assert torch.allclose(stored.float().reshape(()), expected.tensor_scale, rtol=2 ** -23, atol=0)
    with pytest.raises(ValueError, match="convert MXFP4 ones first"):
        write_checkpoint(mx, tmp_path / "out")


def test_faulty_checkpoints_are_refused_with_the_doctors_findings(tmp_path):
    src, _ = llama_dir(tmp_path / "hf")
    quantize_model_dir(src, tmp_path / "nv", layout="modelopt")
    path = tmp_path / "nv" / "model.safetensors"
    t = _tensors(path)
    t["model.layers.0.mlp.down_proj.weight_scale_2"] = torch.tensor(float("nan"))
    del t["model.layers.1.self_attn.o_proj.weight_scale"]
    save_file(t, str(path))
    with pytest.raises(ValueError) as err:
        read_checkpoint(tmp_path / "nv")
    assert "global-scale-not-finite" in str(err.value) and "missing" in str(err.value)
    (tmp_path / "nv" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_checkpoint(tmp_path / "nv")
    with pytest.raises(FileNotFoundError):
        read_checkpoint(tmp_path / "absent")


def test_ptq_refuses_bad_input_and_leaves_nothing_behind(tmp_path):
    src, t = llama_dir(tmp_path / "hf")
    t["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
    save_file(t, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="hold NaN/Inf"):
        quantize_model_dir(src, tmp_path / "nv")
    assert not (tmp_path / "nv").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    src2, _ = llama_dir(tmp_path / "hf2")
    with pytest.raises(ValueError, match="not an empty directory"):
        quantize_model_dir(src2, tmp_path / "full")
    with pytest.raises(ValueError, match="no .safetensors"):
        quantize_model_dir(tmp_path / "full", tmp_path / "nv2")
    # an already-quantized source: by its config, or by its tensors
    quantize_model_dir(src2, tmp_path / "nv3")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model_dir(tmp_path / "nv3", tmp_path / "nv4")
    (tmp_path / "nv3" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="holds quantized tensors"):
        quantize_model_dir(tmp_path / "nv3", tmp_path / "nv4")
    # an exclusion that splits a fused group
    with pytest.raises(ValueError, match="k_proj would stay in high precision"):
        quantize_model_dir(src2, tmp_path / "nv5", exclude=("*.k_proj",))
    assert not any(p.exists() for p in (tmp_path / "nv4", tmp_path / "nv5"))


def test_ptq_quantizes_linears_only_and_reads_the_shards_its_index_names(tmp_path):
    src, t = llama_dir(tmp_path / "hf")
    g = torch.Generator().manual_seed(1)
    extra = {"gpt_neox.embed_out.weight": torch.randn(96, 64, generator=g),       # an output head
             "model.embed_positions.weight": torch.randn(32, 64, generator=g),    # position embeddings
             "model.layers.0.conv.weight": torch.randn(64, 64, 16, generator=g)}  # a convolution
    save_file({k: v.bfloat16() for k, v in extra.items()}, str(src / "extra.safetensors"))
    # a stale full copy beside the shards, as Mistral ships consolidated.safetensors: the index decides
    save_file({k: v * 2 for k, v in t.items()}, str(src / "consolidated.safetensors"))
    (src / "pytorch_model.bin").write_bytes(b"old weights")
    weight_map = {**{k: "model.safetensors" for k in t}, **{k: "extra.safetensors" for k in extra}}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ckpt = quantize_model_dir(src, tmp_path / "nv")
    assert len(ckpt.weights) == 14 and not set(extra) & {f"{m}.weight" for m in ckpt.weights}
    out = _tensors(tmp_path / "nv" / "model.safetensors")
    assert all(torch.equal(out[k], v.bfloat16()) for k, v in extra.items())
    assert torch.equal(out["lm_head.weight"], t["lm_head.weight"])  # the indexed copy, not the doubled one
    assert not (tmp_path / "nv" / "pytorch_model.bin").exists()
    (src / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="in two weight files"):
        quantize_model_dir(src, tmp_path / "nv2")


def test_gpt2_conv1d_projections_are_refused_without_transformers(tmp_path, monkeypatch):
    import fp4lab.hub.ptq as ptq
    src, _ = llama_dir(tmp_path / "hf")
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    monkeypatch.setattr(ptq, "has_transformers", lambda: False)
    with pytest.raises(ValueError, match="Conv1D"):
        quantize_model_dir(src, tmp_path / "nv")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_stray_input_scale_in_a_weight_only_checkpoint_stays_a_plain_tensor(tmp_path, layout):
    src, _ = llama_dir(tmp_path / "hf")
    quantize_model_dir(src, tmp_path / "a", layout=layout)
    t = _tensors(tmp_path / "a" / "model.safetensors")
    stray = f"model.layers.0.self_attn.o_proj.{'input_scale' if layout == 'modelopt' else 'input_global_scale'}"
    t[stray] = torch.tensor(0.01).reshape(() if layout == "modelopt" else (1,))
    save_file(t, str(tmp_path / "a" / "model.safetensors"))
    ckpt = read_checkpoint(tmp_path / "a")
    assert not ckpt.w4a4 and stray in ckpt.dense  # the config declares W4A16: not an activation scale
    write_checkpoint(ckpt, tmp_path / "b")
    b = _tensors(tmp_path / "b" / "model.safetensors")
    assert b.keys() == t.keys() and all(_same_bits(t[k], b[k]) for k in t)
    # a W4A4 checkpoint with an activation scale for some modules only cannot be written
    ckpt.dense.pop(stray)
    ckpt.input_scales["model.layers.0.self_attn.o_proj"] = torch.tensor(0.01)
    with pytest.raises(ValueError, match="activation scale for every quantized module"):
        write_checkpoint(ckpt, tmp_path / "c")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_kv_cache_declaration_is_carried_and_a_replaced_weight_gets_its_own_global(tmp_path, layout):
    src, t = llama_dir(tmp_path / "hf")
    quantize_model_dir(src, tmp_path / "a", layout=layout)
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = scheme
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    if layout == "modelopt":
        hf = json.loads((tmp_path / "a" / "hf_quant_config.json").read_text())
        hf["quantization"]["kv_cache_quant_algo"] = "FP8"
        (tmp_path / "a" / "hf_quant_config.json").write_text(json.dumps(hf))
    ckpt = read_checkpoint(tmp_path / "a")
    m = "model.layers.1.self_attn.o_proj"
    ckpt.weights[m] = quantize_nvfp4(t[f"{m}.weight"].float() * 7)  # a new weight, a new S_dec
    write_checkpoint(ckpt, tmp_path / "b")
    assert check_checkpoint(tmp_path / "b") == []
    written = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]
    assert written["kv_cache_scheme"] == scheme
    if layout == "modelopt":
        hf = json.loads((tmp_path / "b" / "hf_quant_config.json").read_text())
        assert hf["quantization"]["kv_cache_quant_algo"] == "FP8"
    back = read_checkpoint(tmp_path / "b")
    assert torch.equal(back.weights[m].codes, ckpt.weights[m].codes)
    assert torch.allclose(back.weights[m].tensor_scale, ckpt.weights[m].tensor_scale, rtol=2 ** -23, atol=0)
    other = "model.layers.1.mlp.down_proj"  # untouched: its stored scalar kept byte for byte
    assert _same_bits(back.stored_globals[other], ckpt.stored_globals[other])
    with pytest.raises(ValueError, match="KV cache"):
        write_checkpoint(ckpt, tmp_path / "c", layout=[x for x in LAYOUTS if x != layout][0])
