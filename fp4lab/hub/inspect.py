"""``fp4lab inspect DIR`` on an FP4 checkpoint: per quantized module, what its stored numbers say.

Per module: format and shape; the decode global scale (NVFP4); the decoded block scales' min,
median and max; blocks that are all zero (scale 0 or every code 0: a block flushed to zero, or
an all-zero source); blocks whose scale sits at the scale format's largest value (E4M3 448, or
UE8M0 2^127), where the block's amax may have been clipped; and the fraction of elements at
+-6, E2M1's largest magnitude (each block's amax lands there by construction).

Public: ``checkpoint_rows``, ``format_rows``.
"""

from __future__ import annotations

import torch

from ..formats import FP4Tensor, decode_e4m3, decode_ue8m0
from ..formats.types import Format
from .checkpoint import Checkpoint

_E4M3_MAX_BYTE, _UE8M0_MAX_BYTE = 0x7E, 0xFE


def _row(m: str, q: FP4Tensor) -> dict:
    nvfp4 = q.format is Format.NVFP4
    raw = q.scales.view(torch.uint8)
    scales = decode_e4m3(raw) if nvfp4 else decode_ue8m0(raw)
    lo, hi = q.codes & 0xF, q.codes >> 4
    codes = torch.stack([lo, hi], -1).reshape(*q.codes.shape[:-1], -1)  # element 2i in the low nibble
    blocks = codes.reshape(*raw.shape, q.block_len)
    zero = (raw == 0) | ((blocks & 0x7) == 0).all(-1) if nvfp4 else ((blocks & 0x7) == 0).all(-1)
    n = raw.numel()
    return {"module": m, "format": str(q.format), "shape": list(q.shape),
            "global_scale": None if q.tensor_scale is None else float(q.tensor_scale),
            "scale_min": float(scales.min()), "scale_median": float(scales.float().median()),
            "scale_max": float(scales.max()), "blocks": n,
            "zero_blocks": int(zero.sum()), "zero_block_pct": 100.0 * int(zero.sum()) / n,
            "max_scale_blocks": int((raw == (_E4M3_MAX_BYTE if nvfp4 else _UE8M0_MAX_BYTE)).sum()),
            "at_6_pct": 100.0 * float(((codes & 0x7) == 7).float().mean())}


def checkpoint_rows(ckpt: Checkpoint) -> list[dict]:
    """One row per quantized module, in name order."""
    return [_row(m, ckpt.weights[m]) for m in sorted(ckpt.weights)]


def format_rows(rows: list[dict]) -> str:
    head = "| module | format | shape | global scale | block scale min / median / max | zero blocks | " \
           "blocks at max scale | elements at +-6 |\n|---|---|---|---|---|---|---|---|"
    lines = [head]
    for r in rows:
        g = "-" if r["global_scale"] is None else f"{r['global_scale']:.4g}"
        lines.append(f"| {r['module']} | {r['format']} | {'x'.join(map(str, r['shape']))} | {g} | "
                     f"{r['scale_min']:.3g} / {r['scale_median']:.3g} / {r['scale_max']:.3g} | "
                     f"{r['zero_blocks']} ({r['zero_block_pct']:.2f}%) | {r['max_scale_blocks']} | "
                     f"{r['at_6_pct']:.1f}% |")
    return "\n".join(lines)
