"""Convert a gpt-oss-style MXFP4 safetensors checkpoint to NVFP4, one tensor at a time.

Input (docs/numerics.md "Checkpoint layouts"): pairs ``<base>_blocks`` uint8 [..., out, in/32, 16]
(two E2M1 codes a byte, low nibble first) and ``<base>_scales`` uint8 [..., out, in/32] (E8M0);
every other tensor is copied unchanged. Each pair becomes, with ``method`` (default best):

    modelopt            <base>.weight uint8 [..., out, in/2], <base>.weight_scale float8_e4m3fn
                        [..., out, in/16], <base>.weight_scale_2 float32 [] (S_dec, a decode
                        multiplier); hf_quant_config.json beside the output
    compressed-tensors  <base>.weight_packed, <base>.weight_scale, <base>.weight_global_scale
                        float32 [] = 1 / S_dec (an encode multiplier); quantization_config.json

One S_dec per tensor: a fused gate/up expert tensor therefore shares one global scale, which is
what vLLM expects. The output is streamed: its safetensors header is planned from the input's
shapes, then each tensor is converted and written in turn, so peak memory is about one tensor;
it is written to a temporary file and renamed only when complete. A NaN (0xFF) scale is refused
with the tensor's name. ``verify`` reads the output back and checks every tensor.

Public: ``convert_checkpoint``, ``verify_checkpoint``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from ..formats import FP4Tensor, dequantize
from ..formats.types import Format, NVFP4Profile, Choice
from .mxfp4_to_nvfp4 import mxfp4_to_nvfp4

_DTYPES = {"U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16,
           "F16": torch.float16, "I64": torch.int64, "I32": torch.int32, "F64": torch.float64, "BOOL": torch.bool}


class Layout(Choice):
    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed-tensors"


_SUFFIXES = {Layout.MODELOPT: ("weight", "weight_scale", "weight_scale_2"),
             Layout.COMPRESSED_TENSORS: ("weight_packed", "weight_scale", "weight_global_scale")}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc


def _plan(f, layout: Layout) -> list[tuple[str, str, list[int], str | None]]:
    """-> [(output name, safetensors dtype, shape, source key or base)] in writing order."""
    keys = list(f.keys())
    plan = []
    for key in keys:
        if key.endswith("_scales") and key[: -len("_scales")] + "_blocks" in keys:
            continue  # written with its blocks
        if key.endswith("_blocks") and key[: -len("_blocks")] + "_scales" in keys:
            base = key[: -len("_blocks")]
            shape = f.get_slice(key).get_shape()
            if len(shape) < 3 or shape[-1] != 16:
                raise ValueError(f"{key}: MXFP4 blocks must be [..., out, in/32, 16], got {shape}")
            lead, nb = list(shape[:-2]), shape[-2]
            codes, scales, scalar = _SUFFIXES[layout]
            plan += [(f"{base}.{codes}", "U8", lead + [nb * 16], base),
                     (f"{base}.{scales}", "F8_E4M3", lead + [nb * 2], base),
                     (f"{base}.{scalar}", "F32", [], base)]
        else:
            plan.append((key, f.get_slice(key).get_dtype(), list(f.get_slice(key).get_shape()), None))
    return plan


def _nbytes(dtype: str, shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * torch.empty((), dtype=_DTYPES[dtype]).element_size()


def _mx_tensor(f, base: str) -> FP4Tensor:
    blocks, scales = f.get_tensor(base + "_blocks"), f.get_tensor(base + "_scales")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{base}: expected uint8 blocks [..., nb, 16] and uint8 scales [..., nb], got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    if bool((scales == 0xFF).any()):
        raise ValueError(f"{base}_scales holds {int((scales == 0xFF).sum())} NaN (0xFF) scales; refusing to convert")
    lead, nb = list(blocks.shape[:-2]), blocks.shape[-2]
    return FP4Tensor(codes=blocks.reshape(*lead, nb * 16), scales=scales, tensor_scale=None,
                     shape=torch.Size(lead + [nb * 32]), axis=len(lead), block=(1, 32), format=Format.MXFP4,
                     rounding="rtne", mx_mode="rceil")


def convert_checkpoint(src: str | Path, dst: str | Path, *, layout: str | Layout = Layout.MODELOPT,
                       method: str = "best", progress=None) -> dict:
    """src MXFP4 safetensors -> dst NVFP4 safetensors (+ config file); returns the per-tensor report."""
    src, dst, layout = Path(src), Path(dst), Layout.parse(layout)
    with _open(src) as f:
        plan = _plan(f, layout)
        header, offset = {}, 0
        for name, dtype, shape, _ in plan:
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {"format": "pt", "producer": "fp4lab", "quantization": f"nvfp4/{layout}"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        report, tmp = {}, dst.with_name(dst.name + ".tmp")
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as out:
                out.write(struct.pack("<Q", len(blob)) + blob)
                converted = {}
                for name, dtype, shape, base in (progress(plan) if progress else plan):
                    if base is None:
                        tensor = f.get_tensor(name)
                    else:
                        if base not in converted:
                            nv, r = mxfp4_to_nvfp4(_mx_tensor(f, base), method)
                            scalar = nv.tensor_scale if layout is Layout.MODELOPT else 1.0 / nv.tensor_scale
                            converted = {base: [nv.codes, nv.scales, scalar.reshape(())]}  # one tensor at a time
                            report[base] = {"method": r.chosen, "spread": r.spread, "m": r.m,
                                            "blocks_out_of_range": r.blocks_out_of_range, "mse": r.mse,
                                            "lossless": r.lossless}
                        tensor = converted[base].pop(0)
                    out.write(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
    _write_config(dst, layout, report)
    return report


def _write_config(dst: Path, layout: Layout, report: dict) -> None:
    targets = sorted(report)
    if layout is Layout.MODELOPT:
        name, config = "hf_quant_config.json", {
            "producer": {"name": "fp4lab", "version": "0.1.0"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                             "quantized_tensors": targets}}
    else:
        name, config = "quantization_config.json", {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": targets, "weights": {
                "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}}}}
    (dst.parent / name).write_text(json.dumps(config, indent=1))
    (dst.parent / (dst.stem + ".conversion_report.json")).write_text(json.dumps(report, indent=1))


def verify_checkpoint(src: str | Path, dst: str | Path, *, layout: str | Layout = Layout.MODELOPT) -> dict:
    """Read dst back: copied tensors equal, converted ones equal to the MXFP4 values where the
    conversion was lossless, with the reported MSE otherwise. -> {base: max abs difference}."""
    layout = Layout.parse(layout)
    codes_s, scales_s, scalar_s = _SUFFIXES[layout]
    result = {}
    with _open(Path(src)) as f, _open(Path(dst)) as g:
        plan = _plan(f, layout)
        missing = {name for name, *_ in plan} - set(g.keys())
        if missing:
            raise ValueError(f"{dst} lacks {sorted(missing)[:5]}")
        for name, _, _, base in plan:
            if base is None:
                if not torch.equal(f.get_tensor(name), g.get_tensor(name)):
                    raise ValueError(f"{name}: copied tensor differs")
                continue
            if not name.endswith("." + codes_s):
                continue
            mx = _mx_tensor(f, base)
            scalar = g.get_tensor(f"{base}.{scalar_s}")
            nv = FP4Tensor(codes=g.get_tensor(name), scales=g.get_tensor(f"{base}.{scales_s}"),
                           tensor_scale=scalar if layout is Layout.MODELOPT else 1.0 / scalar, shape=mx.shape,
                           axis=mx.axis, block=(1, 16), format=Format.NVFP4, rounding="rtne",
                           profile=NVFP4Profile.TE)
            result[base] = float((dequantize(nv) - dequantize(mx)).abs().max()) if mx.shape.numel() else 0.0
    return result
