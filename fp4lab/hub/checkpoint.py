"""Published FP4 checkpoints in and out: read a ModelOpt or compressed-tensors NVFP4 model
directory, or a gpt-oss-style MXFP4 one, into FP4Tensors; write NVFP4 ones back.

The conventions (docs/checkpoints.md has the sources):

- NVFP4, both layouts: codes uint8 [.., out, in/2], two E2M1 codes a byte, element 2i in the low
  nibble; block scales float8_e4m3fn [.., out, in/16], plain row-major (not swizzled); one FP32
  weight global scale per module. ModelOpt stores the decode multiplier S_dec
  (w = code * s_b * S_dec); compressed-tensors stores the encode multiplier g = 1 / S_dec
  (w = code * s_b / g). An FP4Tensor holds S_dec, so a compressed-tensors scale is read as
  fp32(1 / g); the stored scalar is kept too, and written back unchanged, so that a read and a
  write reproduce the file's bytes.
- W4A4 adds an activation global scale per module in the same convention (ModelOpt
  ``input_scale``, compressed-tensors ``input_global_scale``).
- MXFP4 (gpt-oss): ``<base>_blocks`` uint8 [.., out, in/32, 16] and ``<base>_scales`` uint8
  (UE8M0) [.., out, in/32]; the config says ``quant_method: mxfp4``.

An NVFP4 directory is read only when the checkpoint doctor (verify/checkpoint.py) finds no error
in it: an unknown or inconsistent layout is refused with the doctor's findings, never guessed at.
Writing goes through temporary files renamed into place when all is written (convert/checkpoint.py).

Public: ``Checkpoint``, ``read_checkpoint``, ``write_checkpoint``, ``weight_shards``, ``open_weights``,
``MXFP4``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save

from ..convert.checkpoint import _write_together
from ..convert.layouts import (SPECS, Layout, hf_quant_config, high_precision_modules, quantization_config,
                               quantized_modules)
from ..convert.stream import mx_tensor, open_safetensors
from ..formats import FP4Tensor
from ..formats.types import Format

MXFP4 = "mxfp4"
_WEIGHTS = "model.safetensors"


@dataclass(kw_only=True)
class Checkpoint:
    """A model directory's tensors: quantized weights as FP4Tensors, the rest as they are stored."""

    config: dict
    """config.json (without a quantization_config a writer replaces)"""
    layout: str
    """"modelopt", "compressed-tensors" or "mxfp4" """
    weights: dict[str, FP4Tensor]
    """module -> its quantized weight; NVFP4 tensor_scale is the decode multiplier S_dec"""
    dense: dict[str, torch.Tensor]
    """every other tensor, by its name in the file"""
    stored_globals: dict[str, torch.Tensor] = field(default_factory=dict)
    """module -> the weight global scale as stored (the layout's convention, dtype and shape)"""
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    """module -> the activation global scale as stored (W4A4 checkpoints)"""
    files: dict[str, bytes] = field(default_factory=dict)
    """other top-level files (tokenizer, generation config) by name, carried over by a writer"""
    kv_cache: dict = field(default_factory=dict)
    """the KV-cache quantization the configs declare (compressed-tensors ``kv_cache_scheme``,
    ModelOpt ``kv_cache_quant_algo``), carried over by a writer of the same layout"""

    @property
    def w4a4(self) -> bool:
        return bool(self.input_scales)

    def input_decode(self, module: str) -> torch.Tensor:
        """The activation decode scale S_dec_a ([] float32) of a W4A4 module: as stored (ModelOpt) or
        fp32(1 / g) (compressed-tensors)."""
        return self._input_scale(module, encode=False)

    def input_encode(self, module: str) -> torch.Tensor:
        """The activation encode multiplier g ([] float32): as stored (compressed-tensors) or
        fp32(1 / S_dec_a) (ModelOpt)."""
        return self._input_scale(module, encode=True)

    def _input_scale(self, module: str, *, encode: bool) -> torch.Tensor:
        stored = self.input_scales[module].float().reshape(())
        return torch.reciprocal(stored) if SPECS[Layout.parse(self.layout)].global_is_encode != encode else stored


def read_checkpoint(root: str | Path) -> Checkpoint:
    """Read the model directory ``root``. ValueError, naming each fault, for a directory the doctor
    rejects or an MXFP4 pair it cannot decode; FileNotFoundError for a missing one."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory")
    shards = weight_shards(root)
    config = _config(root)
    with contextlib.ExitStack() as stack:
        keys = open_weights(stack, shards)
        mx = sorted(k[:-7] for k in keys if k.endswith("_blocks") and k[:-7] + "_scales" in keys)
        if mx:
            weights = {base: mx_tensor(keys[base + "_blocks"], base) for base in mx}
            taken = {f"{b}_{s}" for b in mx for s in ("blocks", "scales")}
            dense = {k: f.get_tensor(k) for k, f in keys.items() if k not in taken}
            return Checkpoint(config=_without_quantization(config), layout=MXFP4, weights=weights, dense=dense,
                              files=_other_files(root))
        from ..verify.checkpoint import check_checkpoint
        from ..verify.checkpoint_config import read_declared
        errors = [f for f in check_checkpoint(root) if f.level == "error"]
        if errors:
            raise ValueError(f"{root} is not an NVFP4 checkpoint fp4lab can read; the doctor found:\n"
                             + "\n".join(f"  {f}" for f in errors))
        declared = read_declared(root)
        spec = SPECS[declared.layout]
        headers = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k, f in keys.items()}
        out = Checkpoint(config=_without_quantization(config), layout=str(declared.layout), weights={}, dense={},
                         files=_other_files(root), kv_cache=_kv_cache(root, config))
        taken = set()
        for m in quantized_modules(headers, declared.layout):
            names = [f"{m}.{spec.codes}", f"{m}.{spec.scales}", f"{m}.{spec.global_scale}"]
            codes, scales, stored = (keys[n].get_tensor(n) for n in names)
            if stored.numel() != 1:
                raise ValueError(f"{names[2]}: one global scale per expert ({list(stored.shape)}) is not read yet; "
                                 "fp4lab reads one per module")
            out.weights[m] = _nvfp4(codes, scales, stored, spec.global_is_encode)
            out.stored_globals[m] = stored
            taken.update(names)
            # activation scales only where the config declares W4A4 (the doctor has checked every
            # module has one); a stray one in a weight-only checkpoint stays a plain tensor
            if declared.w4a4:
                out.input_scales[m] = keys[f"{m}.{spec.input_scale}"].get_tensor(f"{m}.{spec.input_scale}")
                taken.add(f"{m}.{spec.input_scale}")
        out.dense = {k: f.get_tensor(k) for k, f in keys.items() if k not in taken}
        return out


def write_checkpoint(ckpt: Checkpoint, dst: str | Path, layout: str | Layout | None = None) -> list[str]:
    """Write ``ckpt``'s NVFP4 weights in ``layout`` (default: the checkpoint's own) as a complete
    model directory ``dst`` (which must not exist or be empty): one model.safetensors, config.json
    with the layout's quantization_config (ModelOpt's hf_quant_config.json besides) and the
    carried-over files. -> the files written. Nothing is left behind if a write fails."""
    dst = Path(dst)
    if any(q.format is not Format.NVFP4 for q in ckpt.weights.values()):
        raise ValueError("write_checkpoint writes NVFP4 weights; convert MXFP4 ones first (fp4lab convert)")
    layout = Layout.parse(layout if layout is not None else ckpt.layout)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} exists and is not an empty directory; refusing to write into it")
    if ckpt.input_scales and set(ckpt.input_scales) != set(ckpt.weights):
        missing = sorted(set(ckpt.weights) - set(ckpt.input_scales)) or sorted(set(ckpt.input_scales) - set(ckpt.weights))
        raise ValueError(f"a W4A4 checkpoint needs an activation scale for every quantized module and no other: "
                         f"{missing[:5]} differ")
    spec, tensors = SPECS[layout], dict(ckpt.dense)
    for m, q in ckpt.weights.items():
        if q.block != (1, 16) or q.axis != q.codes.dim() - 1 or q.scale_layout != "plain":
            raise ValueError(f"{m}: the layouts store 1x16 blocks along the last axis with plain scales, got "
                             f"block {q.block}, axis {q.axis}, {q.scale_layout} scales")
        tensors[f"{m}.{spec.codes}"] = q.codes
        tensors[f"{m}.{spec.scales}"] = q.scales
        tensors[f"{m}.{spec.global_scale}"] = _stored_global(ckpt, m, layout)
        if m in ckpt.input_scales:
            tensors[f"{m}.{spec.input_scale}"] = _convention(ckpt.input_scales[m], Layout.parse(ckpt.layout)
                                                             if ckpt.layout != MXFP4 else layout, layout)
    clash = sorted(set(ckpt.dense) & (set(tensors) - set(ckpt.dense)))
    if clash:
        raise ValueError(f"dense tensors clash with the layout's names: {clash[:5]}")
    if ckpt.kv_cache and ckpt.layout != str(layout):
        raise ValueError(f"the checkpoint declares a quantized KV cache ({ckpt.kv_cache}); fp4lab does not "
                         f"translate it from {ckpt.layout} to {layout}")
    quantized = sorted(ckpt.weights)
    headers = {k: (_st_dtype(v), list(v.shape)) for k, v in tensors.items()}
    kept = high_precision_modules(headers, set(quantized))
    config = dict(ckpt.config, quantization_config=quantization_config(layout, quantized, kept, w4a4=ckpt.w4a4,
                                                                       kv_cache=ckpt.kv_cache))
    files = {dst / _WEIGHTS: lambda out: out.write(save({k: v.contiguous() for k, v in tensors.items()},
                                                        metadata={"format": "pt", "producer": "fp4lab"})),
             dst / "config.json": lambda out: out.write(_json(config))}
    if layout is Layout.MODELOPT:
        files[dst / "hf_quant_config.json"] = lambda out: out.write(_json(hf_quant_config(
            quantized, kept, w4a4=ckpt.w4a4, kv_cache=ckpt.kv_cache)))
    for name, blob in ckpt.files.items():
        files[dst / name] = lambda out, blob=blob: out.write(blob)
    _write_together(dst, files)
    return sorted(p.name for p in files)


def weight_shards(root: Path) -> list[Path]:
    """The .safetensors files holding ``root``'s weights: those its index names, when it has one
    (a directory may hold other copies, e.g. Mistral's consolidated.safetensors), else every one."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise ValueError(f"{index} is not a safetensors index (a weight_map): {err}") from None
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are not there: {missing[:3]}")
        return [root / n for n in names]
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{root} holds no .safetensors file")
    return shards


def open_weights(stack: contextlib.ExitStack, shards: list[Path]) -> dict:
    """tensor name -> the open file holding it (closed with ``stack``); a name in two files is an error."""
    keys: dict = {}
    for shard in shards:
        f = stack.enter_context(open_safetensors(shard))
        for k in f.keys():
            if k in keys:
                raise ValueError(f"{k} is in two weight files (the second: {shard.name}); give the directory "
                                 "a model.safetensors.index.json naming the shards to read")
            keys[k] = f
    return keys


def _nvfp4(codes: torch.Tensor, scales: torch.Tensor, stored: torch.Tensor, encode: bool) -> FP4Tensor:
    g = stored.reshape(()).float()
    s_dec = torch.reciprocal(g) if encode else g
    lead = list(codes.shape[:-1])
    return FP4Tensor(codes=codes, scales=scales, tensor_scale=s_dec, shape=torch.Size(lead + [codes.shape[-1] * 2]),
                     axis=len(lead), block=(1, 16), format=Format.NVFP4, rounding="rtne", profile="te")


def _stored_global(ckpt: Checkpoint, m: str, layout: Layout) -> torch.Tensor:
    """The weight global scale in ``layout``'s convention: as read when the layout is the same and
    it still decodes to the weight's S_dec (a replaced weight has its own), else from S_dec
    (fp32 1 / S_dec for compressed-tensors)."""
    stored = ckpt.stored_globals.get(m)
    if stored is not None and ckpt.layout == str(layout) and torch.equal(
            _nvfp4(ckpt.weights[m].codes, ckpt.weights[m].scales, stored, SPECS[layout].global_is_encode).tensor_scale,
            ckpt.weights[m].tensor_scale.float().reshape(())):
        return stored
    s_dec = ckpt.weights[m].tensor_scale.float()
    value = torch.reciprocal(s_dec) if SPECS[layout].global_is_encode else s_dec
    return value.reshape(SPECS[layout].global_shape)


def _convention(stored: torch.Tensor, have: Layout, want: Layout) -> torch.Tensor:
    """An activation global scale moved from one layout's convention to the other's."""
    if have is want:
        return stored
    flipped = SPECS[have].global_is_encode != SPECS[want].global_is_encode
    value = torch.reciprocal(stored.float()) if flipped else stored.float()
    return value.reshape(SPECS[want].global_shape)


def _config(root: Path) -> dict:
    path = root / "config.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def _kv_cache(root: Path, config: dict) -> dict:
    """The KV-cache declarations of config.json's quantization_config and hf_quant_config.json."""
    found = {}
    scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    if scheme is not None:
        found["kv_cache_scheme"] = scheme
    hf = root / "hf_quant_config.json"
    if hf.exists():
        algo = (json.loads(hf.read_text()).get("quantization") or {}).get("kv_cache_quant_algo")
        if algo is not None:
            found["kv_cache_quant_algo"] = algo
    return found


def _without_quantization(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "quantization_config"}


_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx"}


def _other_files(root: Path) -> dict[str, bytes]:
    """The files a writer carries over: tokenizer, generation config, licence; never weights in
    any format (the written weights replace them) nor the configs and indexes it writes anew."""
    skip = {"config.json", "hf_quant_config.json", "quantization_config.json", "conversion_report.json"}
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())
            if p.is_file() and p.suffix not in _WEIGHT_SUFFIXES and not p.name.endswith(".index.json")
            and p.name not in skip}


_ST_DTYPES = {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.bfloat16: "BF16",
              torch.float16: "F16", torch.int64: "I64", torch.int32: "I32", torch.float64: "F64", torch.bool: "BOOL"}


def _st_dtype(t: torch.Tensor) -> str:
    return _ST_DTYPES.get(t.dtype, str(t.dtype))


def _json(value) -> bytes:
    return json.dumps(value, indent=1).encode()

