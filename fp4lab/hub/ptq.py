"""Post-training quantization of a Hugging Face model directory to an NVFP4 checkpoint
(``fp4lab quantize HF_MODEL_DIR OUT``), weight-only (W4A16), round to nearest even.

What is quantized: every floating weight of 2+ dims whose module is a linear layer, i.e. not an
embedding, not ``lm_head``, not an MoE router (``gate``, ``router``, or a name ending in ``_gate``
such as Qwen2-MoE's ``shared_expert_gate``), with a contraction length
that is a multiple of 16, minus what ``exclude`` patterns (fnmatch) name. Each module gets the
NVFP4 te recipe (formats/nvfp4.py): S_enc = 6 * 448 / amax over the whole weight, except that
projections an engine fuses into one GEMM (q/k/v, gate/up, w1/w3) share one amax, hence one
global scale, as vLLM and TensorRT-LLM require.

Public: ``quantize_model_dir``, ``is_quantizable``.
"""

from __future__ import annotations

import contextlib
import fnmatch
from pathlib import Path

import torch

from ..convert.layouts import FUSED, ROUTERS, Layout
from ..convert.stream import open_safetensors
from ..formats import quantize_nvfp4
from .checkpoint import Checkpoint, _config, _other_files, write_checkpoint

_NOT_LINEAR = ROUTERS | {"lm_head", "embed_tokens", "wte", "wpe", "embed", "embeddings", "word_embeddings"}


def is_quantizable(name: str, t: torch.Tensor, exclude: tuple[str, ...] = ()) -> bool:
    """Whether tensor ``name`` is a linear layer's weight this command quantizes."""
    module, _, leaf = name.rpartition(".")
    return (leaf == "weight" and t.is_floating_point() and t.dim() >= 2 and t.shape[-1] % 16 == 0
            and module.rpartition(".")[2] not in _NOT_LINEAR and not module.endswith("_gate")
            and not any(fnmatch.fnmatchcase(module, p) for p in exclude))


def quantize_model_dir(src: str | Path, dst: str | Path, *, layout: str | Layout = Layout.MODELOPT,
                       exclude: tuple[str, ...] = ()) -> Checkpoint:
    """HF model directory ``src`` (safetensors shards, config.json) -> NVFP4 model directory ``dst``."""
    src = Path(src)
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
    ckpt = Checkpoint(config=_config(src), layout=str(Layout.parse(layout)), weights=weights, dense=tensors,
                      files=_other_files(src))
    ckpt.config.pop("quantization_config", None)
    write_checkpoint(ckpt, dst)
    return ckpt


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
