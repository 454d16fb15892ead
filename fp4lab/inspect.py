"""``fp4lab inspect``: quantize every floating tensor of a checkpoint and tabulate what FP4 loses.

Reads safetensors or torch files (``torch.load(weights_only=True)``: a tensor, or a possibly
nested dict/list of tensors), quantizes each floating tensor along its last axis (zero-padding
ragged rows), and reports formats/stats.py's statistics per tensor.

Public: ``load_tensors``, ``inspect_tensors``, ``format_table``, ``write_demo_tensors``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .formats import Format, FP4Tensor, quant_stats, spec_of


@dataclass(frozen=True, kw_only=True)
class InspectConfig:
    """Which FP4 encoding to measure."""

    format: str = "nvfp4"
    """nvfp4 or mxfp4."""
    profile: str = "te"
    """NVFP4 profile: te or torchao."""
    mode: str = "floor"
    """MXFP4 scale mode: floor, ceil, even or rceil."""
    block: int | tuple[int, int] = 16
    """NVFP4 block: 16, or (16, 16) tiles for 2D tensors (others fall back to 1x16)."""



def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors or torch file -> {name: tensor}; nested containers get dotted names."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path} is neither safetensors nor a torch file of tensors: {exc}") from exc
    flat: dict[str, torch.Tensor] = {}
    _flatten(obj, "", flat)
    if not flat:
        raise ValueError(f"{path} holds no tensors")
    return flat


def _flatten(obj: object, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix or "tensor"] = obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, f"{prefix}.{i}" if prefix else str(i), out)


def inspect_tensors(tensors: dict[str, torch.Tensor], config: InspectConfig) -> list[dict]:
    """{name: tensor} -> one row per tensor: name, shape, dtype, encoding and statistics
    (or ``skipped`` with the reason for non-floating, empty and 0-d tensors)."""
    rows = []
    for name, x in tensors.items():
        row = {"name": name, "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            row["skipped"] = f"{row['dtype']} is not a float type fp4lab quantizes"
        elif x.dim() == 0 or x.numel() == 0:
            row["skipped"] = "scalar or empty"
        else:
            q = _quantize(x, config)
            row["encoding"] = encoding_label(q)
            row.update(quant_stats(x, q))
        rows.append(row)
    return rows


def encoding_label(q: FP4Tensor) -> str:
    """What q really used: nvfp4/<profile>/<1x16|16x16> or mxfp4/<mode>."""
    if q.format is Format.MXFP4:
        return f"mxfp4/{q.mx_mode}"
    return f"nvfp4/{q.profile}/{q.block[0]}x{q.block[1]}"


def _quantize(x: torch.Tensor, config: InspectConfig):
    spec = spec_of(config.format)
    block = config.block if x.dim() == 2 else 16  # 16x16 tiles need a matrix
    return spec.quantize(x, pad=True, **spec.select({"mode": config.mode, "profile": config.profile, "block": block}))


def format_table(rows: list[dict]) -> str:
    """Rows from inspect_tensors -> an aligned plain-text table."""
    header = ["tensor", "shape", "encoding", "SQNR dB", "rel err", "flushed", "saturated", "log2 scale"]
    lines = [header]
    for r in rows:
        shape = "x".join(map(str, r["shape"])) or "()"
        if "skipped" in r:
            lines.append([r["name"], shape, f"skipped: {r['skipped']}", "", "", "", "", ""])
            continue
        lo, hi = r["scale_log2_min"], r["scale_log2_max"]
        span = "-" if math.isnan(lo) else f"[{lo:.1f}, {hi:.1f}]"
        lines.append([r["name"], shape, r["encoding"], f"{r['sqnr_db']:.2f}", f"{r['rel_error']:.4f}",
                      f"{100 * r['flushed_blocks']:.2f}%", f"{100 * r['saturated']:.2f}%", span])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def write_demo_tensors(path: str | Path, seed: int = 0) -> Path:
    """Write a safetensors file of tensors shaped like an LLM's, with the features that make FP4
    hard: Gaussian weights, activations with outlier channels, a heavy tail, tiny gradients, a
    norm weight near 1 and a ragged row length."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    acts = randn(512, 1024)
    acts[:, torch.randperm(1024, generator=g)[:8]] *= 50.0  # a few outlier channels
    student_t = randn(512, 1024) / randn(3, 512, 1024).square().mean(0).sqrt()  # Student-t, 3 dof
    tensors = {
        "mlp.up.weight": (0.02 * randn(1024, 1024)).to(torch.bfloat16),
        "attn.qkv.activations": acts.to(torch.bfloat16),
        "heavy_tail.student_t3": student_t,
        "grad.wgrad_like": 1e-7 * randn(256, 1024),
        "norm.weight": 1.0 + 0.05 * randn(1024),
        "embed.ragged_rows": randn(100, 1000),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path
