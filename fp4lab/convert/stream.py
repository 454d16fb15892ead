"""Convert one gpt-oss-style MXFP4 safetensors file to NVFP4, streamed one tensor at a time.

Input (docs/checkpoints.md): pairs ``<base>_blocks`` uint8 [..., out, in/32, 16] (two E2M1 codes
a byte, low nibble first) and ``<base>_scales`` uint8 [..., out, in/32] (UE8M0); every other
tensor is copied unchanged. Each pair becomes the layout's three tensors (layouts.py) with one
global scale per tensor, so a fused gate/up expert tensor shares one, as vLLM expects.

The output's safetensors header is planned from the input's shapes; then each tensor is read,
converted and written in turn, so peak memory is about one tensor. A NaN (0xFF) scale is refused
with the tensor's name.

Public: ``open_safetensors``, ``plan``, ``header``, ``mx_tensor``, ``write_converted``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from ..formats import FP4Tensor
from ..formats.types import Format
from .layouts import SPECS, Layout
from .mxfp4_to_nvfp4 import mxfp4_to_nvfp4

_ITEMSIZE = {"U8": 1, "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F16": 2, "BF16": 2, "I16": 2,
             "F32": 4, "I32": 4, "U32": 4, "F64": 8, "I64": 8, "U64": 8}

# one planned output tensor: (name, safetensors dtype, shape, MXFP4 base it comes from or None)
Entry = tuple[str, str, list[int], "str | None"]


def open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc


def plan(f, layout: Layout) -> list[Entry]:
    """The output tensors of an open input file, in writing order."""
    keys = list(f.keys())
    spec, out = SPECS[layout], []
    for key in keys:
        if key.endswith("_scales") and key[: -len("_scales")] + "_blocks" in keys:
            continue  # written with its blocks
        if key.endswith("_blocks") and key[: -len("_blocks")] + "_scales" in keys:
            base = key[: -len("_blocks")]
            shape = f.get_slice(key).get_shape()
            if len(shape) < 3 or shape[-1] != 16:
                raise ValueError(f"{key}: MXFP4 blocks must be [..., out, in/32, 16], got {shape}")
            lead, nb = list(shape[:-2]), shape[-2]
            out += [(f"{base}.{spec.codes}", "U8", lead + [nb * 16], base),
                    (f"{base}.{spec.scales}", "F8_E4M3", lead + [nb * 2], base),
                    (f"{base}.{spec.global_scale}", "F32", list(spec.global_shape), base)]
        else:
            out.append((key, f.get_slice(key).get_dtype(), list(f.get_slice(key).get_shape()), None))
    return out


def nbytes(dtype: str, shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * _ITEMSIZE[dtype]


def header(entries: list[Entry], layout: Layout) -> bytes:
    """The output's safetensors header (length-prefixed, padded to 8 bytes), planned from shapes."""
    head, offset = {}, 0
    for name, dtype, shape, _ in entries:
        size = nbytes(dtype, shape)
        head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    head["__metadata__"] = {"format": "pt", "producer": "fp4lab", "quantization": f"nvfp4/{layout}"}
    blob = json.dumps(head, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def mx_tensor(f, base: str) -> FP4Tensor:
    """The MXFP4 pair ``base`` of an open file as an FP4Tensor (codes [..., out, in/2])."""
    blocks, scales = f.get_tensor(base + "_blocks"), f.get_tensor(base + "_scales")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{base}: expected uint8 blocks [..., nb, 16] and uint8 scales [..., nb], got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    if scales.numel() and int(scales.max()) == 0xFF:  # NaN is the largest byte: max vectorizes
        raise ValueError(f"{base}_scales holds {int((scales == 0xFF).sum())} NaN (0xFF) scales; refusing to convert")
    lead, nb = list(blocks.shape[:-2]), blocks.shape[-2]
    return FP4Tensor(codes=blocks.reshape(*lead, nb * 16), scales=scales, tensor_scale=None,
                     shape=torch.Size(lead + [nb * 32]), axis=len(lead), block=(1, 32), format=Format.MXFP4,
                     rounding="rtne", mx_mode="rceil")


def write_converted(f, entries: list[Entry], layout: Layout, method: str, report: dict, out) -> None:
    """Write the converted file to the binary stream ``out``; add each base's report to ``report``."""
    spec = SPECS[layout]
    out.write(header(entries, layout))
    converted: dict[str, list[torch.Tensor]] = {}
    for name, _, shape, base in entries:
        if base is None:
            tensor = f.get_tensor(name)
        else:
            if base not in converted:
                nv, r = mxfp4_to_nvfp4(mx_tensor(f, base), method)
                scalar = 1.0 / nv.tensor_scale if spec.global_is_encode else nv.tensor_scale
                converted = {base: [nv.codes, nv.scales, scalar.reshape(spec.global_shape)]}  # one at a time
                report[base] = {"method": r.chosen, "spread": r.spread, "m": r.m,
                                "blocks_out_of_range": r.blocks_out_of_range, "mse": r.mse, "lossless": r.lossless}
            tensor = converted[base].pop(0)
        # the tensor's own memory goes to the file: no bytes() copy
        out.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
