"""Convert a gpt-oss-style MXFP4 model directory to a complete NVFP4 model directory.

SRC is a model directory (``config.json``, ``*.safetensors`` shards, maybe
``model.safetensors.index.json``, tokenizer files) or a single ``.safetensors`` file. DST, a
directory that must not exist yet or be empty, receives:

- each shard under its own name, MXFP4 pairs converted (stream.py), other tensors copied;
- ``model.safetensors.index.json`` rewritten for the new tensor names (when SRC has one);
- ``config.json`` with SRC's MXFP4 ``quantization_config`` (and its ``modules_to_not_convert``)
  replaced by the layout's, whose ignore / exclude lists name what stayed in high precision
  (layouts.py); ModelOpt's ``hf_quant_config.json`` besides;
- every other top-level file of SRC (tokenizer, generation config, chat template, licence),
  byte for byte; weight files of other formats and subdirectories are left out and named in
  the result;
- ``conversion_report.json``: per converted tensor the method, spread, m and MSE.

Everything is written under temporary names and renamed only when all is complete: a failure
(a bad tensor, a full disk) leaves no output file, whole or partial.

Public: ``convert_checkpoint``, ``ConvertResult``, ``INDEX``, ``REPORT``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .layouts import Layout, hf_quant_config, high_precision_modules, quantization_config
from .stream import nbytes, open_safetensors, plan, write_converted

INDEX = "model.safetensors.index.json"
REPORT = "conversion_report.json"
# written anew, or stale once the weights change: never carried over
_REWRITTEN = {"config.json", "hf_quant_config.json", "quantization_config.json", INDEX, REPORT}
_OTHER_WEIGHTS = {".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz", ".onnx"}


@dataclass(frozen=True, kw_only=True)
class ConvertResult:
    report: dict[str, dict]
    """per converted tensor base: method, spread, m, blocks_out_of_range, mse, lossless"""
    written: list[str]
    """the files of DST"""
    left_out: list[str]
    """top-level entries of SRC not carried over (subdirectories, other weight formats)"""


def _inputs(src: Path) -> tuple[list[Path], list[Path], list[str], dict]:
    """-> (shards, files to carry over, entries left out, the input config.json or {})."""
    if src.is_file():
        return [src], [], [], {}
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such file or directory")
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{src} holds no .safetensors file")
    if (src / INDEX).exists():
        listed = set(json.loads((src / INDEX).read_text()).get("weight_map", {}).values())
        missing = sorted(listed - {s.name for s in shards})
        if missing:
            raise ValueError(f"{src / INDEX} lists shards that are not there: {missing}")
    carry, left_out = [], []
    for entry in sorted(src.iterdir()):
        if entry.suffix == ".safetensors" or entry.name in _REWRITTEN:
            continue
        if entry.is_file() and entry.suffix not in _OTHER_WEIGHTS:
            carry.append(entry)
        else:
            left_out.append(entry.name + ("/" if entry.is_dir() else ""))
    config = {}
    if (src / "config.json").exists():
        try:
            config = json.loads((src / "config.json").read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{src / 'config.json'} is not valid JSON: {err}") from None
    return shards, carry, left_out, config


def _model_config(config: dict, layout: Layout, quantized: list[str], high_precision: list[str]) -> dict:
    """SRC's config.json with its quantization config (MXFP4, modules_to_not_convert) replaced."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    out["quantization_config"] = quantization_config(layout, quantized, high_precision)
    return out


def convert_checkpoint(src: str | Path, dst: str | Path, *, layout: str | Layout = Layout.MODELOPT,
                       method: str = "best") -> ConvertResult:
    """MXFP4 model directory (or one .safetensors file) src -> NVFP4 model directory dst.
    ValueError for an input with no MXFP4 pair or a non-empty dst; an I/O error (read-only
    folder, full disk) leaves no output file behind."""
    src, dst, layout = Path(src), Path(dst), Layout.parse(layout)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} exists and is not an empty directory; refusing to write into it")
    shards, carry, left_out, config = _inputs(src)
    with contextlib.ExitStack() as stack:
        opened = [(shard, stack.enter_context(open_safetensors(shard))) for shard in shards]
        plans = {shard.name: (f, plan(f, layout)) for shard, f in opened}
        headers, quantized = {}, set()
        for f, entries in plans.values():
            headers.update({k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()})
            quantized.update(base for *_, base in entries if base is not None)
        if not quantized:
            raise ValueError(f"{src} holds no MXFP4 tensor pair (<base>_blocks uint8 with <base>_scales): "
                             "nothing to convert")
        quantized = sorted(quantized)
        kept = high_precision_modules(headers, set(quantized))
        report: dict[str, dict] = {}
        files: dict[Path, Callable] = {}
        for name, (f, entries) in plans.items():
            files[dst / name] = lambda out, f=f, entries=entries: write_converted(f, entries, layout, method,
                                                                                    report, out)
        if (src / INDEX).exists() or len(shards) > 1:
            weight_map = {e[0]: name for name, (_, entries) in plans.items() for e in entries}
            total = sum(nbytes(dtype, shape) for _, entries in plans.values() for _, dtype, shape, _ in entries)
            files[dst / INDEX] = lambda out: out.write(_json({"metadata": {"total_size": total},
                                                              "weight_map": weight_map}))
        files[dst / "config.json"] = lambda out: out.write(_json(_model_config(config, layout, quantized, kept)))
        if layout is Layout.MODELOPT:
            files[dst / "hf_quant_config.json"] = lambda out: out.write(_json(hf_quant_config(quantized, kept)))
        for path in carry:
            files[dst / path.name] = lambda out, path=path: _copy(path, out)
        files[dst / REPORT] = lambda out: out.write(_json(report))  # last: the shards fill it
        _write_together(dst, files)
    return ConvertResult(report=report, written=sorted(p.name for p in files), left_out=left_out)


def _copy(path: Path, out) -> None:
    with open(path, "rb") as f:
        shutil.copyfileobj(f, out, 16 << 20)


def _write_together(dst: Path, files: dict[Path, Callable]) -> None:
    """Write each file under a temporary name, in order, then rename them all into place: a
    failure on the way (permissions, a full disk) removes the temporaries, and dst if it was
    made here, and leaves none of the outputs rather than some of them or a truncated one."""
    made = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    tmps = {path: path.with_name(f".{path.name}.tmp-{os.getpid()}") for path in files}
    done = False
    try:
        for path, write in files.items():
            with open(tmps[path], "wb") as out:
                write(out)
        for path, tmp in tmps.items():
            os.replace(tmp, path)
        done = True
    finally:
        for tmp in tmps.values():
            with contextlib.suppress(OSError):  # the cleanup must not hide the error that led here
                tmp.unlink(missing_ok=True)
        if made and not done:
            with contextlib.suppress(OSError):
                dst.rmdir()


def _json(value) -> bytes:
    return json.dumps(value, indent=1).encode()
