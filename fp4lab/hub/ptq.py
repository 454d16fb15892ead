"""Post-training quantization of a Hugging Face model directory to an NVFP4 checkpoint
(``fp4lab quantize HF_MODEL_DIR OUT``), weight-only (W4A16), round to nearest even.

What is quantized: the weights of linear layers, and nothing that only looks like one. A tensor
qualifies by its name and shape: ``<module>.weight``, floating, 2-D (3-D only under an ``experts``
module), a contraction length that is a multiple of 16, and a module that is not an embedding,
an output head (``lm_head``, GPT-NeoX's ``embed_out``) or an MoE router (``gate``, ``router``, or
a name ending in ``_gate`` such as Qwen2-MoE's ``shared_expert_gate``), minus what ``exclude``
patterns (fnmatch) name. Where ``transformers`` is installed, the architecture is also built on
the meta device (no memory, no weights) and a module it holds as anything but an ``nn.Linear``
(an embedding, a convolution, GPT-2's Conv1D, whose weight is stored [in, out]) is not
quantized, whatever its name; without ``transformers``, GPT-2-style models are refused.

Each module gets the NVFP4 te recipe (formats/nvfp4.py): S_enc = 6 * 448 / amax over the whole
weight, except that projections an engine fuses into one GEMM (layouts.FUSED: q/k/v, gate/up,
w1/w3, MLA's q_a/kv_a) share one amax, hence one global scale, as vLLM and TensorRT-LLM require;
a fused group is quantized whole or not at all (an exclusion that splits one is refused).

With a calibration text the checkpoint is W4A4 (NVFP4 activations too): the BF16 model runs on
the text (transformers builds it from the directory) and each quantized Linear's activation
global scale comes from the largest |input| it saw, S_dec_a = amax / (6 * 448), stored in the
layout's convention. Only modules the built model holds as an ``nn.Linear`` can be calibrated
this way (transformers' fused MoE expert tensors cannot: such a model is refused for W4A4).

Refused before any work: a destination that is not empty, a source that is already quantized
(a ``quantization_config``, FP8 or packed tensors), NaN/Inf in a weight.

Public: ``quantize_model_dir``, ``is_quantizable``, ``calibrate``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import warnings
from pathlib import Path

import torch

from ..convert.layouts import FUSED, ROUTERS, SPECS, Layout
from ..formats import quantize_nvfp4
from .checkpoint import Checkpoint, _config, _other_files, open_weights, weight_shards, write_checkpoint
from .hf import has_transformers, transformers_module

E2M1_E4M3 = 6.0 * 448.0
_NOT_LINEAR = ROUTERS | {"lm_head", "embed_out", "embed_tokens", "wte", "wpe", "embed", "embeddings",
                         "word_embeddings", "embed_positions", "position_embeddings", "shared"}
_CONV1D_MODELS = {"gpt2", "openai-gpt", "imagegpt", "decision_transformer"}  # Conv1D: weights [in, out]


def is_quantizable(name: str, t: torch.Tensor, exclude: tuple[str, ...] = ()) -> bool:
    """Whether tensor ``name`` is by its name and shape a linear layer's weight this command quantizes."""
    module, _, leaf = name.rpartition(".")
    dims_ok = t.dim() == 2 or (t.dim() == 3 and ".experts" in f".{module}")
    return (leaf == "weight" and t.is_floating_point() and dims_ok and t.shape[-1] % 16 == 0
            and module.rpartition(".")[2] not in _NOT_LINEAR and not module.endswith("_gate")
            and not any(fnmatch.fnmatchcase(module, p) for p in exclude))


def quantize_model_dir(src: str | Path, dst: str | Path, *, layout: str | Layout = Layout.MODELOPT,
                       exclude: tuple[str, ...] = (), calibration: str | None = None, seq_len: int = 512,
                       max_windows: int = 8) -> Checkpoint:
    """HF model directory ``src`` (safetensors shards, config.json) -> NVFP4 model directory ``dst``;
    W4A4 with a ``calibration`` text, else weight-only."""
    src, dst, layout = Path(src), Path(dst), Layout.parse(layout)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} exists and is not an empty directory; refusing to write into it")
    if not src.is_dir():
        raise ValueError(f"{src}: not a model directory")
    if calibration is not None:
        transformers_module()  # missing: say so before any work
    config = _config(src)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"{src} is already quantized (quant_method {method}); quantize from its BF16/FP16 original")
    with contextlib.ExitStack() as stack:
        files = open_weights(stack, weight_shards(src))
        tensors = {k: f.get_tensor(k) for k, f in files.items()}
    packed = [k for k, t in tensors.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
              or k.endswith(("_blocks", ".weight_scale", ".weight_scale_inv", ".weight_packed"))]
    if packed:
        raise ValueError(f"{src} holds quantized tensors ({', '.join(packed[:3])}); quantize from its BF16/FP16 "
                         "original")
    chosen = _choose(src, config, tensors, exclude)
    bad = [k for k in chosen if not bool(torch.isfinite(tensors[k]).all())]
    if bad:
        raise ValueError(f"{', '.join(bad)} hold NaN/Inf values; refusing to quantize")
    amax = _group_amax({k[: -len(".weight")]: tensors[k] for k in chosen})
    weights = {k[: -len(".weight")]: quantize_nvfp4(tensors.pop(k).float(), global_amax=amax[k[: -len(".weight")]])
               for k in chosen}
    ckpt = Checkpoint(config=config, layout=str(layout), weights=weights, dense=tensors, files=_other_files(src))
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
    write_checkpoint(ckpt, dst)
    return ckpt


def _choose(src: Path, config: dict, tensors: dict[str, torch.Tensor], exclude: tuple[str, ...]) -> list[str]:
    """The weight tensors to quantize (module docstring): by name and shape, vetoed by the built
    architecture where transformers can build it, fused groups whole."""
    chosen = sorted(k for k, t in tensors.items() if is_quantizable(k, t, exclude))
    kinds = _module_kinds(src) if has_transformers() else None
    if kinds is None and config.get("model_type") in _CONV1D_MODELS:
        raise ValueError(f"{src}: a {config['model_type']} model stores its projections as Conv1D ([in, out]), "
                         "which fp4lab quantize does not handle; install transformers to quantize what is nn.Linear")
    if kinds is not None:
        chosen = [k for k in chosen if kinds.get(k[: -len(".weight")], True)]
    if not chosen:
        raise ValueError(f"{src}: no linear weight to quantize (2-D, last dim a multiple of 16, an nn.Linear)")
    picked = {k[: -len(".weight")] for k in chosen}
    for m in sorted(picked):
        parent, _, leaf = m.rpartition(".")
        for group in FUSED:
            if leaf in group:
                present = [p for p in group if f"{parent}.{p}.weight" in tensors]
                left = [p for p in present if f"{parent}.{p}" not in picked]
                if left:
                    raise ValueError(f"{parent}: {', '.join(left)} would stay in high precision beside "
                                     f"{', '.join(p for p in present if p not in left)}; an engine fuses "
                                     f"{'/'.join(group)} into one GEMM: quantize or exclude them together")
    return chosen


def _module_kinds(src: Path) -> dict[str, bool] | None:
    """module name -> whether the architecture holds it as an nn.Linear, from a model built on the
    meta device; None where transformers cannot build this architecture (names decide alone)."""
    transformers = transformers_module()
    try:
        config = transformers.AutoConfig.from_pretrained(str(src))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError, ImportError, TypeError) as err:  # an unknown or custom architecture
        warnings.warn(f"transformers cannot build {src} ({err}); choosing linears by name alone", stacklevel=3)
        return None
    return {name: isinstance(module, torch.nn.Linear) for name, module in model.named_modules() if name}


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
            members = [f"{parent}.{p}" for p in group if f"{parent}.{p}" in own]
            if leaf == group[0] or (leaf in group and members and members[0] == m):
                shared = torch.stack([own[n] for n in members]).amax()
                out.update({n: shared for n in members})
    return out
