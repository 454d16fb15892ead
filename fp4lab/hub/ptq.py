"""Post-training quantization of a Hugging Face model directory to an NVFP4 checkpoint
(``fp4lab quantize HF_MODEL_DIR OUT``), weight-only (W4A16), round to nearest even.

What is quantized: every floating weight of 2+ dims whose module is a linear layer, i.e. not an
embedding, not ``lm_head``, not an MoE router (``gate``, ``router``, or a name ending in ``_gate``
such as Qwen2-MoE's ``shared_expert_gate``), with a contraction length
that is a multiple of 16, minus what ``exclude`` patterns (fnmatch) name. Each module gets the
NVFP4 te recipe (formats/nvfp4.py): S_enc = 6 * 448 / amax over the whole weight, except that
projections an engine fuses into one GEMM (q/k/v, gate/up, w1/w3) share one amax, hence one
global scale, as vLLM and TensorRT-LLM require.

With a calibration text the checkpoint is W4A4 (NVFP4 activations too): the BF16 model runs on
the text (transformers builds it from the directory) and each quantized Linear's activation
global scale comes from the largest |input| it saw, S_dec_a = amax / (6 * 448), stored in the
layout's convention. Only modules the built model holds as an ``nn.Linear`` can be calibrated
this way (transformers' fused MoE expert tensors cannot: such a model is refused for W4A4).

Public: ``quantize_model_dir``, ``is_quantizable``, ``calibrate``.
"""

from __future__ import annotations

import contextlib
import fnmatch
from pathlib import Path

import torch

from ..convert.layouts import FUSED, ROUTERS, SPECS, Layout
from ..convert.stream import open_safetensors
from ..formats import quantize_nvfp4
from .checkpoint import Checkpoint, _config, _other_files, write_checkpoint
from .hf import transformers_module

E2M1_E4M3 = 6.0 * 448.0
_NOT_LINEAR = ROUTERS | {"lm_head", "embed_tokens", "wte", "wpe", "embed", "embeddings", "word_embeddings"}


def is_quantizable(name: str, t: torch.Tensor, exclude: tuple[str, ...] = ()) -> bool:
    """Whether tensor ``name`` is a linear layer's weight this command quantizes."""
    module, _, leaf = name.rpartition(".")
    return (leaf == "weight" and t.is_floating_point() and t.dim() >= 2 and t.shape[-1] % 16 == 0
            and module.rpartition(".")[2] not in _NOT_LINEAR and not module.endswith("_gate")
            and not any(fnmatch.fnmatchcase(module, p) for p in exclude))


def quantize_model_dir(src: str | Path, dst: str | Path, *, layout: str | Layout = Layout.MODELOPT,
                       exclude: tuple[str, ...] = (), calibration: str | None = None, seq_len: int = 512,
                       max_windows: int = 8) -> Checkpoint:
    """HF model directory ``src`` (safetensors shards, config.json) -> NVFP4 model directory ``dst``;
    W4A4 with a ``calibration`` text, else weight-only."""
    src, layout = Path(src), Layout.parse(layout)
    shards = sorted(src.glob("*.safetensors")) if src.is_dir() else []
    if not shards:
        raise ValueError(f"{src}: not a model directory with .safetensors weights")
    with contextlib.ExitStack() as stack:
        tensors = {}
        for shard in shards:
            f = stack.enter_context(open_safetensors(shard))
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    chosen = sorted(k for k, t in tensors.items() if is_quantizable(k, t, exclude))
    if not chosen:
        raise ValueError(f"{src}: no linear weight to quantize (2+ dims, last dim a multiple of 16)")
    bad = [k for k in chosen if not bool(torch.isfinite(tensors[k]).all())]
    if bad:
        raise ValueError(f"{', '.join(bad)} hold NaN/Inf values; refusing to quantize")
    amax = _group_amax({k[: -len(".weight")]: tensors[k] for k in chosen})
    weights = {k[: -len(".weight")]: quantize_nvfp4(tensors.pop(k).float(), global_amax=amax[k[: -len(".weight")]])
               for k in chosen}
    ckpt = Checkpoint(config=_config(src), layout=str(layout), weights=weights, dense=tensors,
                      files=_other_files(src))
    if calibration is not None:
        amax = calibrate(src, calibration, seq_len=seq_len, max_windows=max_windows)
        missing = sorted(set(weights) - set(amax))
        if missing:
            raise ValueError(f"W4A4 calibration saw no nn.Linear input for {len(missing)} quantized modules (e.g. "
                             f"{missing[0]}; fused MoE experts cannot be calibrated here): quantize weight-only")
        encode = SPECS[layout].global_is_encode
        for m in weights:
            s_dec = (amax[m] / E2M1_E4M3).float()
            if not bool(s_dec > 0):
                raise ValueError(f"{m}: its calibration input was all zero; no activation scale can be set")
            ckpt.input_scales[m] = (torch.reciprocal(s_dec) if encode else s_dec).reshape(SPECS[layout].global_shape)
    ckpt.config.pop("quantization_config", None)
    write_checkpoint(ckpt, dst)
    return ckpt


@torch.no_grad()
def calibrate(src: str | Path, text: str, *, seq_len: int = 512, max_windows: int = 8) -> dict[str, torch.Tensor]:
    """Run the model of directory ``src`` on ``text``; -> per nn.Linear, the largest |input| seen."""
    transformers = transformers_module()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(src))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    n = min(max(1, tokens.numel() // seq_len), max_windows)
    amax: dict[str, torch.Tensor] = {}

    def hook(_, args, __, name):
        seen = args[0].detach().abs().amax().float()
        amax[name] = torch.maximum(amax[name], seen) if name in amax else seen

    hooks = [module.register_forward_hook(lambda mod, a, y, name=name: hook(mod, a, y, name))
             for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    try:
        for i in range(n):
            window = tokens[i * seq_len: (i + 1) * seq_len]
            if window.numel():
                model(window[None])
    finally:
        for h in hooks:
            h.remove()
    return amax


def _group_amax(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """module -> the amax its global scale comes from: its own, or its fused group's."""
    own = {m: w.detach().abs().amax().float() for m, w in weights.items()}
    out = dict(own)
    for m in own:
        parent, _, leaf = m.rpartition(".")
        for group in FUSED:
            if leaf == group[0]:
                members = [f"{parent}.{p}" for p in group if f"{parent}.{p}" in own]
                shared = torch.stack([own[n] for n in members]).amax()
                out.update({n: shared for n in members})
    return out
