"""PTQ of real transformers models (random weights: nothing can be downloaded here), read back."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4lab.formats import dequantize
from fp4lab.hub import quantize_model_dir, read_checkpoint
from fp4lab.verify.checkpoint import check_checkpoint

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
MODELS = {"llama": lambda: transformers.LlamaConfig(**SMALL),
          "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=4,
                                                           num_experts_per_tok=2)}


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_a_transformers_model_quantizes_reads_back_and_still_predicts(tmp_path, arch, layout):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[arch]()).eval()
    model.save_pretrained(tmp_path / "hf")
    quantize_model_dir(tmp_path / "hf", tmp_path / "nv", layout=layout)
    assert check_checkpoint(tmp_path / "nv") == []
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "nv"))
    assert config.quantization_config["quant_method"] == layout
    ckpt = read_checkpoint(tmp_path / "nv")
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    linears = {k[:-7] for k, v in saved.items() if v.dim() == 2 and "embed" not in k}
    routers = {n for n in linears if n.endswith("mlp.gate")}
    assert set(ckpt.weights) == linears - routers - {"lm_head"}
    assert (len(routers) == 2) == (arch == "qwen3_moe")
    assert sum(".experts." in m for m in ckpt.weights) == (2 * 4 * 3 if arch == "qwen3_moe" else 0)
    # the dequantized model predicts like the original on random tokens (NVFP4 error, not a wrong layout)
    state = {f"{m}.weight": dequantize(q).reshape(q.shape) for m, q in ckpt.weights.items()}
    (tmp_path / "deq").mkdir()
    save_file({**ckpt.dense, **state}, str(tmp_path / "deq" / "model.safetensors"))
    (tmp_path / "deq" / "config.json").write_text(json.dumps(ckpt.config))
    emulated = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "deq")).eval()
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = model(tokens).logits, emulated(tokens).logits
    err, agree = float((got - ref).norm() / ref.norm()), float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    # a random model's logits are nearly flat, so top-1 flips easily; the logit error is the check
    # (measured 0.09 llama, 0.13 qwen3_moe: NVFP4's ~10% error per weight matrix)
    assert err < 0.25 and agree > 0.6


def test_what_the_architecture_holds_as_no_linear_is_never_quantized(tmp_path):
    # GPT-2's projections are Conv1D, their weights stored [in, out]: by name and shape they look
    # quantizable (c_attn, c_fc, ...); the model built on the meta device says they are not Linears
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="no linear weight"):
        quantize_model_dir(tmp_path / "hf", tmp_path / "nv")
    assert not (tmp_path / "nv").exists()
