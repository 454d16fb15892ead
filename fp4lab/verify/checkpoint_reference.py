"""The checkpoint doctor's value check against the MXFP4 source a checkpoint was converted from.

Copied tensors must be equal. A converted module's values, block_values(NVFP4) * decode
multiplier in float64, must match the MXFP4 values with the MSE ``conversion_report.json``
records (0 where the conversion was lossless; exactly 0 when there is no report). When they do
not, two faults are tried and named when they explain the difference: nibbles swapped in every
byte (the element order E2M1 packing fixes, low nibble first), and block scales stored in the
swizzled 128x4 layout where the linear one is declared. Neither leaves a trace in shapes or
magnitudes, which is why only a reference can name them for certain.

Public: ``compare_to_reference``.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch

from ..convert.checkpoint import REPORT
from ..convert.layouts import SPECS, Layout
from ..convert.stream import mx_tensor, open_safetensors
from ..formats import FP4Tensor, block_values, unswizzle_scales
from ..formats.types import Format, NVFP4Profile
from .finding import Finding


def _swap_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes << 4) | (codes >> 4)


def _unswizzle(scales: torch.Tensor, rows: int, cols: int, lead: list[int]) -> torch.Tensor | None:
    """Read each matrix's scale bytes as a swizzled buffer; None when the sizes cannot be one."""
    per = scales.reshape(math.prod(lead), -1)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    if per.shape[1] != rp * cp:
        return None
    return torch.stack([unswizzle_scales(b, rows, cols) for b in per]).reshape(*lead, rows, cols)


def _mse(mx: FP4Tensor, codes: torch.Tensor, scales: torch.Tensor, decode: torch.Tensor,
         reference: torch.Tensor) -> float:
    nv = FP4Tensor(codes=codes, scales=scales, tensor_scale=None, shape=mx.shape, axis=mx.axis, block=(1, 16),
                   format=Format.NVFP4, rounding="rtne", profile=NVFP4Profile.TE)
    got = block_values(nv).double() * decode
    return float((got - reference).square().sum()) / max(mx.shape.numel(), 1)


def _module(mx: FP4Tensor, stored: dict, expected_mse: float, layout: Layout, m: str) -> Finding | None:
    spec = SPECS[layout]
    codes, scales, g = stored["codes"], stored["scales"], stored["global"].double().reshape(-1)
    lead, rows, cols = list(codes.shape[:-2]), codes.shape[-2], codes.shape[-1] // 8
    decode = 1 / g if spec.global_is_encode else g
    decode = decode.reshape(*lead, 1, 1) if decode.numel() > 1 else decode.reshape(())  # per expert or one
    reference = block_values(mx).double()

    def explains(c, s) -> bool:
        return s is not None and tuple(s.shape) == (*lead, rows, cols) and math.isclose(
            _mse(mx, c, s, decode, reference), expected_mse, rel_tol=1e-6, abs_tol=0.0)

    if explains(codes, scales):
        return None
    if explains(_swap_nibbles(codes), scales):
        return Finding("error", "nibbles-swapped", f"{m}.{spec.codes}", "the high and low nibbles of every byte "
                       "are swapped (E2M1 packing puts the first element in the low nibble)")
    if explains(codes, _unswizzle(scales, rows, cols, lead)):
        return Finding("error", "scales-swizzled", f"{m}.{spec.scales}", "block scales are in the swizzled "
                       "128x4 layout where the layout declares linear (row-major) scales")
    got = _mse(mx, codes, scales, decode, reference) if tuple(scales.shape) == (*lead, rows, cols) else math.nan
    return Finding("error", "values-differ", m, f"differs from the MXFP4 source: MSE {got:.6g}, "
                   f"expected {expected_mse:.6g}")


def compare_to_reference(shards, quantized: list[str], layout: Layout, reference: Path, root: Path) -> list[Finding]:
    """Findings for tensors of ``shards`` (verify.checkpoint) that disagree with ``reference``."""
    spec, out = SPECS[layout], []
    report = json.loads((root / REPORT).read_text()) if (root / REPORT).exists() else {}
    paths = sorted(reference.glob("*.safetensors")) if reference.is_dir() else [reference]
    with contextlib.ExitStack() as stack:
        ref = {}
        for path in paths:
            f = stack.enter_context(open_safetensors(path))
            ref.update({k: f for k in f.keys()})
        for name in shards.headers:
            if name in ref and not torch.equal(ref[name].get_tensor(name), shards.tensor(name)):
                out.append(Finding("error", "copied-tensor-differs", name, "differs from the reference"))
        for m in quantized:
            if m + "_blocks" not in ref:
                out.append(Finding("warning", "no-reference", m, "has no MXFP4 pair in the reference"))
                continue
            names = {"codes": spec.codes, "scales": spec.scales, "global": spec.global_scale}
            if any(f"{m}.{s}" not in shards.headers for s in names.values()):
                continue  # named already by the structure checks
            stored = {k: shards.tensor(f"{m}.{s}") for k, s in names.items()}
            mx = mx_tensor(ref[m + "_blocks"], m)
            if tuple(stored["codes"].shape) != tuple(mx.codes.shape):
                out.append(Finding("error", "values-differ", m, f"codes {list(stored['codes'].shape)} do not match "
                                   f"the source's {list(mx.codes.shape)}"))
                continue
            finding = _module(mx, stored, float(report.get(m, {}).get("mse", 0.0)), layout, m)
            if finding is not None:
                out.append(finding)
    return out
