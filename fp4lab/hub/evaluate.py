"""Evaluate a published FP4 checkpoint without Blackwell: ``fp4lab eval CHECKPOINT --text FILE``.

The architecture comes from the checkpoint's config.json through Hugging Face ``transformers``
(an optional dependency: ``pip install fp4lab[hub]``). Every quantized module that the built
model holds as an ``nn.Linear`` becomes a ``StoredNVFP4Linear``: it keeps the checkpoint's codes
and scales and multiplies as an FP4 tensor core does, y = (x @ (code * s_b)^T) * S_dec with FP32
accumulation (code * s_b is exact in any float format); in a W4A4 checkpoint its input is first
quantized to NVFP4 (1x16 blocks along K, te scales) with the checkpoint's static activation
global scale. Quantized weights the model does not hold as a Linear (transformers' fused MoE
expert tensors) are loaded dequantized (exact in FP32) and counted as such in the report.

With a reference (the BF16 model the checkpoint came from) the report adds top-1 agreement of the
next-token predictions and, per quantized Linear, the relative error of its output on the
reference's own input, which isolates that layer's quantization from the error upstream.

Public: ``StoredNVFP4Linear``, ``load_emulated``, ``evaluate``.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..formats import FP4Tensor, block_values, dequantize, quantize_nvfp4
from ..formats.types import Format
from .checkpoint import MXFP4, Checkpoint, _json, read_checkpoint
from .hf import transformers_module as _transformers

class StoredNVFP4Linear(nn.Module):
    """A Linear computing with a checkpoint's NVFP4 weight as stored (module docstring).

    W4A4: ``input_encode`` is the activation's encode multiplier g and ``input_decode`` the
    factor the GEMM's output takes, as engines derive them from the checkpoint (vLLM: ModelOpt
    stores S_dec_a, so g = fp32(1 / S_dec_a) and the output takes S_dec_a as stored;
    compressed-tensors stores g, and the output takes fp32(1 / g)). Block scales come from g:
    e4m3(block amax * g * fp32(1/6)), the te rule."""

    def __init__(self, weight: FP4Tensor, bias: torch.Tensor | None, input_encode: torch.Tensor | None = None,
                 input_decode: torch.Tensor | None = None):
        super().__init__()
        if weight.format is not Format.NVFP4 or weight.codes.dim() != 2:
            raise ValueError(f"StoredNVFP4Linear takes a 2-D NVFP4 weight, got {weight.format} {list(weight.shape)}")
        if (input_encode is None) != (input_decode is None):
            raise ValueError("a W4A4 layer needs both the activation encode and decode scales")
        self.out_features, self.in_features = weight.shape
        # code * s_b has at most 5 significant bits, within 2^-10..2688: exact in BF16, half of FP32's memory
        self.register_buffer("values", block_values(weight)[:, : self.in_features].to(torch.bfloat16).contiguous())
        self.register_buffer("s_dec", weight.tensor_scale.float().reshape(()))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.register_buffer("input_encode", None if input_encode is None else input_encode.float().reshape(()))
        self.register_buffer("input_decode", None if input_decode is None else input_decode.float().reshape(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, xf = x.shape[:-1], x.reshape(-1, self.in_features).float()
        alpha = self.s_dec
        if self.input_encode is not None:
            qa = quantize_nvfp4(xf, global_encode=self.input_encode)
            xf, alpha = block_values(qa)[:, : self.in_features], alpha * self.input_decode
        y = (xf @ self.values.float().T) * alpha
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)


def load_emulated(ckpt: Checkpoint, root: Path, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """The checkpoint's model with its quantized Linears as StoredNVFP4Linear, on ``device``;
    -> (model, counts)."""
    if ckpt.layout == MXFP4:
        raise ValueError("fp4lab eval runs NVFP4 checkpoints; convert an MXFP4 one first (fp4lab convert)")
    transformers = _transformers()
    with tempfile.TemporaryDirectory() as tmp:  # transformers maps the file's names onto its modules
        state = {**ckpt.dense, **{f"{m}.weight": dequantize(q).reshape(q.shape) for m, q in ckpt.weights.items()}}
        save_file({k: v.contiguous() for k, v in state.items()}, str(Path(tmp) / "model.safetensors"))
        (Path(tmp) / "config.json").write_bytes(_json(ckpt.config))
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
    swapped = 0
    for m, q in ckpt.weights.items():
        try:
            module = model.get_submodule(m)
        except AttributeError:
            continue
        if isinstance(module, nn.Linear):
            parent, _, leaf = m.rpartition(".")
            w4a4 = m in ckpt.input_scales
            layer = StoredNVFP4Linear(q, module.bias, ckpt.input_encode(m) if w4a4 else None,
                                      ckpt.input_decode(m) if w4a4 else None)
            setattr(model.get_submodule(parent) if parent else model, leaf, layer)
            swapped += 1
    return model.to(device), {"emulated_linears": swapped, "dequantized_weights": len(ckpt.weights) - swapped}


def _windows(tokens: torch.Tensor, seq_len: int, limit: int | None) -> list[torch.Tensor]:
    n = (tokens.numel() - 1) // seq_len
    if n == 0:
        raise ValueError(f"the text has {tokens.numel()} tokens: fewer than one window of {seq_len} + 1")
    n = min(n, limit) if limit else n
    return [tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]


@torch.no_grad()
def evaluate(checkpoint: str | Path, text: str, *, reference: str | Path | None = None, seq_len: int = 512,
             max_windows: int | None = None, device: str | None = None) -> dict:
    """Perplexity of the emulated checkpoint on ``text`` (and the reference's, top-1 agreement,
    per-layer error with a reference), on ``device`` (default: CUDA where there is one); -> the
    report as a dict, with the wall time of each model's forward passes."""
    transformers, root = _transformers(), Path(checkpoint)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ckpt = read_checkpoint(root)
    tok_dir = root if any(root.glob("tokenizer*")) else Path(reference) if reference else None
    if tok_dir is None:
        raise ValueError(f"{root} has no tokenizer files; give --reference with one")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    windows = _windows(tokens, seq_len, max_windows)
    model, counts = load_emulated(ckpt, root, device=device)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval().to(device) \
        if reference else None
    nll, ref_nll, agree, count = 0.0, 0.0, 0, 0
    seconds = {"emulated": 0.0, "reference": 0.0}
    layer_err: dict[str, list[float]] = {}
    for i, w in enumerate(windows):
        inputs, targets = w[None, :-1].to(device), w[None, 1:].to(device)
        logits = _timed(lambda: model(inputs).logits.float(), seconds, "emulated", device)
        nll += float(nn.functional.cross_entropy(logits[0], targets[0], reduction="sum"))
        count += targets.numel()
        if ref is not None:
            hooks = _layer_errors(ref, model, layer_err) if i == 0 else []
            # the first window also runs every emulated layer on the reference's inputs: not timed
            ref_logits = ref(inputs).logits.float() if hooks else \
                _timed(lambda: ref(inputs).logits.float(), seconds, "reference", device)
            for h in hooks:
                h.remove()
            ref_nll += float(nn.functional.cross_entropy(ref_logits[0], targets[0], reduction="sum"))
            agree += int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
    report = {"checkpoint": str(root), "layout": ckpt.layout, "w4a4": ckpt.w4a4, "tokens": count,
              "windows": len(windows), "seq_len": seq_len, **counts, "device": _device_name(device),
              "nll": nll / count, "perplexity": math.exp(nll / count),
              "emulated_s": seconds["emulated"], "emulated_tokens_per_s": count / max(seconds["emulated"], 1e-9)}
    if ref is not None:
        timed = count - windows[0].numel() + 1  # the reference's first window is not timed
        report.update(reference=str(reference), reference_nll=ref_nll / count,
                      reference_perplexity=math.exp(ref_nll / count), top1_agreement=agree / count,
                      reference_s=seconds["reference"],
                      reference_tokens_per_s=timed / seconds["reference"] if seconds["reference"] else None,
                      layer_error={m: v[0] for m, v in sorted(layer_err.items())})
    return report


def _timed(fn, seconds: dict, key: str, device: torch.device):
    """fn() with its wall time added to seconds[key] (synchronizing a GPU before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds[key] += time.perf_counter() - start
    return out


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _layer_errors(ref: nn.Module, model: nn.Module, out: dict[str, list[float]]) -> list:
    """Hooks on the reference's Linears whose emulated twin exists: feed the twin the reference's
    input and record ||y_emulated - y_reference|| / ||y_reference||."""
    hooks = []
    for name, module in model.named_modules():
        if not isinstance(module, StoredNVFP4Linear):
            continue

        def hook(_, args, y, twin=module, name=name):
            err = (twin(args[0]).float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)
            out.setdefault(name, []).append(float(err))

        hooks.append(ref.get_submodule(name).register_forward_hook(hook))
    return hooks


def format_report(r: dict) -> str:
    lines = [f"{r['checkpoint']}: {r['layout']} {'W4A4' if r['w4a4'] else 'W4A16'}, "
             f"{r['emulated_linears']} Linears emulated, {r['dequantized_weights']} weights dequantized; "
             f"{r['tokens']} tokens in {r['windows']} windows of {r['seq_len']} on {r['device']}, "
             f"{r['emulated_tokens_per_s']:,.0f} tokens/s emulated"
             + (f" ({r['reference_tokens_per_s']:,.0f} reference)" if r.get("reference_tokens_per_s") else ""),
             "", "| model | nll | perplexity |", "|---|---|---|",
             f"| emulated FP4 | {r['nll']:.4f} | {r['perplexity']:.3f} |"]
    if "reference" in r:
        lines.append(f"| reference | {r['reference_nll']:.4f} | {r['reference_perplexity']:.3f} |")
        gap = r["nll"] - r["reference_nll"]
        lines += ["", f"gap {gap:+.4f} nats ({100 * gap / r['reference_nll']:+.2f}%), top-1 agreement "
                  f"{100 * r['top1_agreement']:.2f}%"]
        worst = sorted(r["layer_error"].items(), key=lambda kv: -kv[1])[:5]
        lines += ["", "largest per-layer relative output errors (first window): "
                  + ", ".join(f"{m} {e:.4f}" for m, e in worst)]
    return "\n".join(lines)


def plot_layer_error(r: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, errs = zip(*r["layer_error"].items())
    fig, ax = plt.subplots(figsize=(max(6, 0.18 * len(names)), 3.2))
    ax.bar(range(len(names)), errs)
    ax.set_xticks(range(len(names)), [n.replace("model.layers.", "") for n in names], rotation=90, fontsize=6)
    ax.set_ylabel("relative output error")
    ax.set_title(f"per-layer NVFP4 error, {Path(r['checkpoint']).name} (on the reference's inputs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
