"""A small gpt-oss-style MXFP4 model directory, shaped like openai/gpt-oss-20b's on the Hub:
two shards with an index, a config.json with the MXFP4 quantization_config, tokenizer files
and an ``original/`` subdirectory. Tensor names follow the transformers gpt-oss checkpoint."""

import json

import torch
from safetensors.torch import save_file

from fp4lab.formats import quantize_mxfp4

HIDDEN, EXPERTS, LAYERS = 64, 4, 2
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
CONFIG = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": HIDDEN,
          "intermediate_size": 48, "num_hidden_layers": LAYERS, "num_local_experts": EXPERTS,
          "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "vocab_size": 50, "max_position_embeddings": 4096, "sliding_window": 128,
          "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 150000, "tie_word_embeddings": False,
          "torch_dtype": "bfloat16",
          "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}}


def gpt_oss_tensors(spread_outlier: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(50, HIDDEN, generator=g).bfloat16(),
         "lm_head.weight": torch.randn(50, HIDDEN, generator=g).bfloat16(),
         "model.norm.weight": torch.ones(HIDDEN).bfloat16()}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        for n, out in {"q": 64, "k": 32, "v": 32, "o": HIDDEN}.items():
            t[p + f"self_attn.{n}_proj.weight"] = torch.randn(out, 64, generator=g).bfloat16()
        t[p + "self_attn.sinks"] = torch.zeros(4).bfloat16()
        t[p + "mlp.router.weight"] = torch.randn(EXPERTS, HIDDEN, generator=g).bfloat16()
        t[p + "mlp.router.bias"] = torch.zeros(EXPERTS).bfloat16()
        for name, (out, inp) in {"gate_up_proj": (96, HIDDEN), "down_proj": (HIDDEN, 64)}.items():
            w = torch.randn(EXPERTS, out, inp, generator=g) * 0.02
            if spread_outlier and name == "down_proj" and layer == 0:
                w[0, 0, 0] = 1e4  # exponent spread > 17: not lossless
            q = quantize_mxfp4(w, mode="rceil")
            t[p + f"mlp.experts.{name}_blocks"] = q.codes.reshape(EXPERTS, out, inp // 32, 16)
            t[p + f"mlp.experts.{name}_scales"] = q.scales
            t[p + f"mlp.experts.{name}_bias"] = torch.zeros(EXPERTS, out).bfloat16()
    return t


def gpt_oss_dir(root, spread_outlier: bool = False, tensors: dict | None = None):
    """Write the model directory at root; -> root."""
    root.mkdir(parents=True, exist_ok=True)
    t = gpt_oss_tensors(spread_outlier) if tensors is None else tensors
    keys = sorted(t)
    shards = {"model-00000-of-00001.safetensors": keys[: len(keys) // 2],
              "model-00001-of-00001.safetensors": keys[len(keys) // 2:]}
    for shard, names in shards.items():
        save_file({k: t[k] for k in names}, str(root / shard))
    weight_map = {k: shard for shard, names in shards.items() for k in names}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(CONFIG))
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "generation_config.json").write_text('{"eos_token_id": 2}')
    (root / "chat_template.jinja").write_text("{{ messages }}")
    (root / "original").mkdir()
    (root / "original" / "config.json").write_text("{}")
    return root
