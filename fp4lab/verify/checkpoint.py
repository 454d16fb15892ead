"""The checkpoint doctor: check an NVFP4 model directory against the layout it declares and name
each deviation, one ``Finding`` each (``fp4lab verify checkpoint DIR``).

Checks, in order (docs/checkpoints.md "The checkpoint doctor" has the heuristics and their limits):

- the config (checkpoint_config.py): layout, NVFP4 fields, W4A4 or weight-only, ignore lists;
- the shards and ``model.safetensors.index.json`` agree; no tensor of the other layout, no
  MXFP4 pair left unconverted;
- per quantized module: codes uint8 [.., out, in/2], block scales float8_e4m3fn [.., out, in/16]
  (a 128x4-padded shape is named as swizzled scales), an FP32 global scale that is finite and
  positive and in the layout's convention (the implied weight magnitude 6 * max(block scale) *
  decode multiplier is plausible, its inverse reading is not), and for W4A4 an input global
  scale per module (per expert), finite and positive;
- fused q/k/v and gate/up (w1/w3) projections share one weight global scale;
- routers and lm_head stay in high precision; what stays in high precision is ignored by the
  config, and what is quantized is targeted and not ignored;
- with ``reference`` (the MXFP4 source): every value against it (checkpoint_reference.py), which
  also names swapped nibbles and swizzled scale bytes.

Public: ``check_checkpoint``, ``Finding``, ``WEIGHT_AMAX_LIMIT``, ``ACT_AMAX_LIMIT``.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch

from ..convert.layouts import FUSED, ROUTERS, SPECS, Layout, high_precision_modules, matches, quantized_modules
from ..convert.stream import open_safetensors
from .checkpoint_config import Declared, read_declared
from .finding import Finding

WEIGHT_AMAX_LIMIT = 1e4
"""|w| of trained LLM layers stays far below this; 6 * 448 * 2688 / amax lies far above it"""
ACT_AMAX_LIMIT = 1e5
"""activations reach 1e3-1e4 ("massive activations"); the inverse reading of 2688 / amax above"""
E2M1_MAX, E4M3_MAX = 6.0, 448.0


class _Shards:
    """Every tensor of a directory's shards by name: (shard, dtype, shape); tensors read on demand."""

    def __init__(self, root: Path, stack: contextlib.ExitStack, findings: list[Finding]):
        self.files, self.headers, self.where = {}, {}, {}
        for shard in sorted(root.glob("*.safetensors")):
            f = stack.enter_context(open_safetensors(shard))
            self.files[shard.name] = f
            for key in f.keys():
                if key in self.where:
                    findings.append(Finding("error", "duplicate-tensor", key,
                                            f"in both {self.where[key]} and {shard.name}"))
                s = f.get_slice(key)
                self.headers[key], self.where[key] = (s.get_dtype(), list(s.get_shape())), shard.name

    def tensor(self, name: str) -> torch.Tensor:
        return self.files[self.where[name]].get_tensor(name)


def _index(root: Path, shards: _Shards) -> list[Finding]:
    path = root / "model.safetensors.index.json"
    if not path.exists():
        return [Finding("error", "index", path.name, "absent, with several shards")] if len(shards.files) > 1 else []
    weight_map = json.loads(path.read_text()).get("weight_map", {})
    out = [Finding("error", "index", name, f"listed in {path.name} under {shard}, which does not hold it")
           for name, shard in weight_map.items() if shards.where.get(name) != shard]
    out += [Finding("error", "index", name, f"in {shards.where[name]} but not in {path.name}")
            for name in shards.where if name not in weight_map]
    return out


def _swizzled_shape(shape: list[int], expected: list[int]) -> bool:
    """Whether a scale tensor holds as many bytes as the swizzled (128x4-padded) scales would."""
    rp, cp = -(-expected[-2] // 128) * 128, -(-expected[-1] // 4) * 4
    return shape != expected and math.prod(shape) == math.prod(expected[:-2]) * rp * cp


def _global(shards: _Shards, name: str, lead: list[int], out: list[Finding]) -> torch.Tensor | None:
    """A global scale's values (float64), with findings for a missing, mistyped or bad one."""
    if name not in shards.headers:
        return None
    dtype, shape = shards.headers[name]
    if dtype != "F32" or math.prod(shape) not in (1, math.prod(lead)):
        out.append(Finding("error", "global-scale-shape", name, f"is {dtype} {shape}, expected one F32 value"
                           + (f" (or one per expert, {lead})" if lead else "")))
        return None
    g = shards.tensor(name).double().reshape(-1)
    if not bool(torch.isfinite(g).all()):
        out.append(Finding("error", "global-scale-not-finite", name, f"holds {int((~torch.isfinite(g)).sum())} "
                           "NaN/Inf values"))
        return None
    if bool((g <= 0).any()):
        out.append(Finding("error", "global-scale-not-positive", name, f"holds {int((g <= 0).sum())} values <= 0 "
                           f"(min {float(g.min()):g}): the engine divides by it, so outputs become Inf/NaN"))
        return None
    return g


def _module(shards: _Shards, m: str, declared: Declared, out: list[Finding]) -> torch.Tensor | None:
    """Check one quantized module's tensors; -> its weight global scale values (decode convention)."""
    spec = SPECS[declared.layout]
    codes, scales = f"{m}.{spec.codes}", f"{m}.{spec.scales}"
    cdtype, cshape = shards.headers[codes]
    if cdtype != "U8" or len(cshape) < 2:
        out.append(Finding("error", "codes-dtype", codes, f"is {cdtype} {cshape}, expected U8 [.., out, in/2]"))
        return None
    lead, expected = cshape[:-2], cshape[:-1] + [cshape[-1] * 2 // 16]
    if scales not in shards.headers:
        out.append(Finding("error", "missing-tensor", scales, "absent: the block scales of " + codes))
        return None
    sdtype, sshape = shards.headers[scales]
    if sdtype != "F8_E4M3":
        out.append(Finding("error", "scales-dtype", scales, f"is {sdtype}, expected F8_E4M3"))
    elif cshape[-1] % 8 or sshape != expected:
        fault = ("scales-swizzled", "has the 128x4-padded size of swizzled scales where the layout declares "
                 "linear ones") if _swizzled_shape(sshape, expected) else ("scales-shape", "")
        out.append(Finding("error", fault[0], scales, f"shape {sshape}, expected {expected} (in/16 per row) "
                           + fault[1]))
    g_name = f"{m}.{spec.global_scale}"
    if g_name not in shards.headers:
        out.append(Finding("error", "missing-tensor", g_name, "absent: the weight global scale"))
    g = _global(shards, g_name, lead, out)
    if g is not None and sdtype == "F8_E4M3" and sshape == expected:
        decode = 1 / g if spec.global_is_encode else g
        block_max = shards.tensor(scales).float().reshape(g.numel(), -1).amax(-1).double()
        amax, inverse = E2M1_MAX * block_max * decode, E2M1_MAX * block_max / decode
        live = block_max > 0
        if bool((amax[live] > WEIGHT_AMAX_LIMIT).any()):
            conv = "an encode multiplier (compressed-tensors)" if not spec.global_is_encode else \
                "a decode multiplier (ModelOpt)"
            if bool((inverse[live] <= WEIGHT_AMAX_LIMIT).all()):
                out.append(Finding("error", "global-scale-convention", g_name,
                                   f"implies |w| up to {float(amax[live].max()):.3g}; read as {conv} it gives "
                                   f"{float(inverse[live].max()):.3g}: stored in the other layout's convention?"))
            else:
                out.append(Finding("warning", "implausible-magnitude", g_name,
                                   f"implies |w| up to {float(amax[live].max()):.3g} either way it is read"))
        return decode
    return None


def _input_scale(shards: _Shards, m: str, declared: Declared, lead: list[int], out: list[Finding]) -> None:
    spec = SPECS[declared.layout]
    name = f"{m}.{spec.input_scale}"
    if not declared.w4a4:
        if name in shards.headers:
            out.append(Finding("warning", "unused-input-scale", name, "present, but the config declares "
                               "weight-only quantization: engines ignore it"))
        return
    if name not in shards.headers:
        out.append(Finding("error", "missing-input-scale", name, "absent, and the config declares NVFP4 "
                           "activations: engines load it as 0, an infinite global scale, NaN outputs"))
        return
    g = _global(shards, name, lead, out)
    if g is not None:
        decode = 1 / g if spec.global_is_encode else g
        if bool((E4M3_MAX * E2M1_MAX * decode > ACT_AMAX_LIMIT).all()) and \
                bool((E4M3_MAX * E2M1_MAX / decode <= ACT_AMAX_LIMIT).all()):
            out.append(Finding("warning", "global-scale-convention", name, "implies activations up to "
                               f"{float(E4M3_MAX * E2M1_MAX * decode.max()):.3g}: stored in the other layout's "
                               "convention?"))


def _fused(globals_: dict[str, torch.Tensor], kept: list[str]) -> list[Finding]:
    """Projections an engine fuses into one GEMM: all quantized or none, with one global scale."""
    out, modules, seen = [], set(globals_) | set(kept), set()
    for m in sorted(modules):
        parent, _, leaf = m.rpartition(".")
        for group in FUSED:
            if leaf not in group or (parent, group) in seen:
                continue
            seen.add((parent, group))
            present = [f"{parent}.{p}" for p in group if f"{parent}.{p}" in modules]
            members = [n for n in present if n in globals_]
            if members and len(members) < len(present):
                leaves = lambda names: ", ".join(n.rpartition(".")[2] for n in names)  # noqa: E731
                out.append(Finding("error", "fused-partly-quantized", parent, f"{leaves(members)} quantized but "
                                   f"{leaves(n for n in present if n not in globals_)} in high precision; an "
                                   "engine fuses them into one GEMM of one format"))
                continue
            values = [globals_[n] for n in members]
            if any(v.shape != values[0].shape or not torch.equal(v, values[0]) for v in values):
                shown = ", ".join(f"{n.rpartition('.')[2]} {float(v.max()):.6g}" for n, v in zip(members, values))
                out.append(Finding("error", "fused-global-scale", parent, "fused projections have different "
                                   f"weight global scales ({shown}); an engine keeps one for the fused GEMM"))
    return out


def _consistency(declared: Declared, quantized: list[str], kept: list[str]) -> list[Finding]:
    out = []
    for m in quantized:
        leaf = m.rpartition(".")[2]
        if leaf in ROUTERS:
            out.append(Finding("error", "quantized-router", m, "the MoE router is quantized; engines expect it "
                               "in high precision"))
        elif leaf == "lm_head":
            out.append(Finding("warning", "quantized-lm-head", m, "lm_head is quantized; most NVFP4 checkpoints "
                               "keep it in high precision"))
        if any(matches(m, p) for p in declared.ignore):
            out.append(Finding("error", "ignored-but-quantized", m, "is quantized but the config's ignore list "
                               "matches it: an engine would load its codes as a high-precision weight"))
        explicit = [t for t in declared.targets or [] if t.startswith("re:") or "." in t]
        if declared.targets is not None and explicit == declared.targets and not any(matches(m, t) for t in explicit):
            out.append(Finding("error", "untargeted", m, "is quantized but no config group targets it"))
    for m in kept:
        if any(matches(m, p) for p in declared.ignore):
            continue
        explicit = [t for t in declared.targets or [] if t.startswith("re:") or "." in t]
        if explicit and explicit == declared.targets and not any(matches(m, t) for t in explicit):
            continue  # the targets are module patterns, and none names it
        if "embed" not in m:  # embeddings are no Linear: an engine does not quantize them
            out.append(Finding("error", "not-ignored", m, "stays in high precision but the config does not "
                               "ignore it: an engine would look for its NVFP4 tensors"))
    return out


def check_checkpoint(root: str | Path, *, reference: str | Path | None = None) -> list[Finding]:
    """Check the NVFP4 model directory ``root``; -> the findings (none: it passed)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory")
    declared = read_declared(root)
    if isinstance(declared, list):
        return declared
    out = declared.findings
    spec, other = SPECS[declared.layout], SPECS[Layout.MODELOPT if declared.layout is Layout.COMPRESSED_TENSORS
                                                 else Layout.COMPRESSED_TENSORS]
    with contextlib.ExitStack() as stack:
        shards = _Shards(root, stack, out)
        if not shards.files:
            return out + [Finding("error", "no-tensors", str(root), "holds no .safetensors file")]
        out += _index(root, shards)
        # ModelOpt's codes are named like a plain weight: a uint8 one beside block scales gives them away
        foreign = {other.codes, other.global_scale, other.input_scale} - {"weight", spec.codes, spec.scales}
        for name, (dtype, _) in shards.headers.items():
            m, _, leaf = name.rpartition(".")
            if leaf in foreign or leaf == other.codes == "weight" and dtype == "U8" and f"{m}.{other.scales}" \
                    in shards.headers:
                out.append(Finding("error", "other-layout", name, f"is a tensor name of the other layout, not "
                                   f"{declared.layout}"))
            elif name.endswith("_blocks") and name[:-7] + "_scales" in shards.headers:
                out.append(Finding("error", "unconverted-mxfp4", name[:-7], "MXFP4 pair left unconverted"))
        quantized = quantized_modules(shards.headers, declared.layout)
        globals_ = {}
        for m in quantized:
            decode = _module(shards, m, declared, out)
            if decode is not None:
                globals_[m] = decode
            _input_scale(shards, m, declared, shards.headers[f"{m}.{spec.codes}"][1][:-2], out)
        kept = high_precision_modules(shards.headers, set(quantized))
        out += _fused(globals_, kept)
        out += _consistency(declared, quantized, kept)
        if not quantized:
            out.append(Finding("error", "no-quantized-module", str(root), f"no {declared.layout} NVFP4 module found"))
        if reference is not None:
            from .checkpoint_reference import compare_to_reference
            out += compare_to_reference(shards, quantized, declared.layout, Path(reference), root)
    return out
