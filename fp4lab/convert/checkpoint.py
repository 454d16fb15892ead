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
it and its config and report files are written under temporary names and renamed only when
all are complete. A NaN (0xFF) scale is refused
with the tensor's name. ``verify`` reads the output back and checks every tensor.

Public: ``convert_checkpoint``, ``verify_checkpoint``.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import Callable

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
    """src MXFP4 safetensors -> dst NVFP4 safetensors (+ config file); returns the per-tensor report.
    ValueError for an input with no MXFP4 pair; an I/O error (read-only folder, full disk) leaves
    no output file behind, whole or partial."""
    src, dst, layout = Path(src), Path(dst), Layout.parse(layout)
    with _open(src) as f:
        plan = _plan(f, layout)
        if not any(base is not None for *_, base in plan):
            raise ValueError(f"{src} holds no MXFP4 tensor pair (<base>_blocks uint8 with <base>_scales): "
                             "nothing to convert")
        report: dict[str, dict] = {}

        def tensors(out) -> None:
            out.write(_header(plan, layout))
            converted = {}
            for name, _, _, base in (progress(plan) if progress else plan):
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

        config_name, config = _config(layout)
        dst.parent.mkdir(parents=True, exist_ok=True)
        _write_together({dst: tensors,  # first: the config and report need its report
                         dst.parent / config_name: lambda out: out.write(_json(config(sorted(report)))),
                         dst.parent / (dst.stem + ".conversion_report.json"): lambda out: out.write(_json(report))})
    return report


def _header(plan: list, layout: Layout) -> bytes:
    """The output's safetensors header (length-prefixed, padded to 8 bytes), planned from shapes."""
    header, offset = {}, 0
    for name, dtype, shape, _ in plan:
        size = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt", "producer": "fp4lab", "quantization": f"nvfp4/{layout}"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def _write_together(files: dict[Path, Callable]) -> None:
    """Write each file under a temporary name, in order, then rename them all into place: a
    failure on the way (permissions, a full disk) removes the temporaries and leaves none of
    the outputs, rather than some of them or a truncated one."""
    tmps = {path: path.with_name(f".{path.name}.tmp-{os.getpid()}") for path in files}
    try:
        for path, write in files.items():
            with open(tmps[path], "wb") as out:
                write(out)
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    finally:
        for tmp in tmps.values():
            with contextlib.suppress(OSError):  # the cleanup must not hide the error that led here
                tmp.unlink(missing_ok=True)


def _json(value) -> bytes:
    return json.dumps(value, indent=1).encode()


def _config(layout: Layout) -> tuple[str, Callable[[list[str]], dict]]:
    """The layout's config file: its name, and its content for the converted tensor bases."""
    if layout is Layout.MODELOPT:
        return "hf_quant_config.json", lambda targets: {
            "producer": {"name": "fp4lab", "version": "0.1.0"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                             "quantized_tensors": targets}}
    return "quantization_config.json", lambda targets: {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": targets, "weights": {
            "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}}}}


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
