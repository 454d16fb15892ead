"""One GEMM of a recipe: rotate, dither and quantize its operands, then multiply.

``quantize_operand`` turns a 2D operand into what the GEMM consumes, following its
recipe.Operand field by field:

    rotate    hadamard_transform along the contraction axis (both operands, so it cancels),
              rounded to the operand's dtype as TE does; fused into the NVFP4 quantize when the
              size is 16 (same bytes: the quantizer rotates the same way)
    dither    (weights) t + dither * unit * (u - 1/2), unit = the element's block scale times
              the tensor scale from an RTNE quantization of t, u from Philox bytes of the seed
    quantize  fp4lab.kernels.quantize_values with the operand's format and the format's own
              knobs (formats.FORMAT_SPECS), padded to the block size

An FP4 operand is ``BlockValues`` (exact bf16 code * block scale and the tensor scale; the
kernels face picks the backend that writes them), or an FP4Tensor where codes are asked for
(``codes=True``: weight diagnostics). With statistics, the FP4Tensor is made first, measured,
then decoded to BlockValues: the same operand either way.

``run_gemm`` multiplies one pair: both FP4 -> kernels.values_mm (FP32 accumulation of the exact
products, alpha once); both dense -> a plain matmul in their dtype (what nn.Linear does); mixed
(one side kept BF16) -> the FP4 side dequantized, an FP32 matmul. Operands are given with their
contraction axis: A [rows_a, L] (axis 1) or its transpose [L, rows_a] (axis 0), likewise B; the
result is [rows_a, rows_b].

Seeds: ``derive_seed(root, *parts)`` (SplitMix64 over the parts) gives every stochastic choice
its own stream from the recipe seed, the layer, the step and the GEMM, so runs replay exactly
and nothing draws from torch's global generator.

Public: ``Rotation``, ``derive_seed``, ``derive_seeds``, ``rotation_for``, ``quantize_operand``, ``run_gemm``,
``dither``, ``gemm_dtype``, ``operand_knobs``, ``fuses_rotation``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from .. import kernels
from ..kernels import BlockValues
from ..formats import FP4Tensor, hadamard_transform, quant_stats, random_bytes
from ..formats.dequantize import block_scales
from ..formats.hadamard import HadamardSigns
from .recipe import GemmSpec, HadamardMode, Operand

_MASK64 = (1 << 64) - 1
FIXED_SIGNS_TAG = 0x51C7
# SplitMix64: the fold's start, and the finalizer's two multipliers (shifts 30, 27, 31)
_START, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def derive_seed(*parts: int) -> int:
    """-> a seed in [0, 2**63) from integer parts (SplitMix64 finalizer folded over them)."""
    h = _START
    for part in parts:
        h = (h ^ (part & _MASK64)) & _MASK64
        h = ((h ^ (h >> 30)) * _MIX1) & _MASK64
        h = ((h ^ (h >> 27)) * _MIX2) & _MASK64
        h ^= h >> 31
    return h >> 1


def derive_seeds(first: Sequence[int], *parts: int | Sequence[int]) -> list[int]:
    """[derive_seed(first[i], *(p[i] if a sequence else p for p in parts)) for each i], folded for
    all elements at once (an MoE projection's experts, a step's seed table: one pass of array
    arithmetic instead of a Python fold per element; numpy's uint64 arithmetic wraps as the masks
    above do)."""
    h = seed_start(len(first))
    for part in (first, *parts):
        h = seed_fold(h, seed_column(part))
    return (h >> np.uint64(1)).tolist()


def seed_column(part: int | Sequence[int]) -> np.ndarray:
    """Parts of derive_seed as uint64 (negative ones two's-complement, as its mask reads them)."""
    values = [part] if isinstance(part, int) else part
    return np.array([v & _MASK64 for v in values], dtype=np.uint64)


def seed_fold(h: np.ndarray, part: np.ndarray) -> np.ndarray:
    """One step of derive_seed's fold over uint64 arrays: h (the fold so far, _START to begin) with
    ``part`` folded in; derive_seed's value is the last fold shifted right once."""
    h = h ^ part
    h = (h ^ (h >> np.uint64(30))) * np.uint64(_MIX1)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(_MIX2)
    return h ^ (h >> np.uint64(31))


def seed_start(n: int) -> np.ndarray:
    """n folds at their start (derive_seed's first state)."""
    return np.full(n, _START, dtype=np.uint64)


class Rotation(NamedTuple):
    """A concrete Hadamard rotation: sign rule, size, and the seed for random signs."""

    signs: HadamardSigns
    size: int
    seed: int | torch.Tensor = 0


def rotation_for(spec: GemmSpec, root: int, step_seed: int | torch.Tensor) -> Rotation | None:
    """The rotation ``spec`` asks for; ``step_seed`` re-draws RANDOM signs (per layer and step; a
    device seed where the step's seeds live in a nn.seeds.SeedTable)."""
    if spec.hadamard is HadamardMode.NONE:
        return None
    if spec.hadamard is HadamardMode.DETERMINISTIC:
        return Rotation(HadamardSigns.NONE, spec.hadamard_size)
    if spec.hadamard is HadamardMode.FIXED and spec.hadamard_size == 16:
        return Rotation(HadamardSigns.TE, 16)
    seed = derive_seed(root, FIXED_SIGNS_TAG) if spec.hadamard is HadamardMode.FIXED else step_seed
    return Rotation(HadamardSigns.RANDOM, spec.hadamard_size, seed)


def dither(t: torch.Tensor, op: Operand, seed: int | torch.Tensor) -> torch.Tensor:
    """t: [N, K] weight -> t + op.dither * unit * (u - 1/2) in t's dtype (see the module doc); the
    seed an int or its slot in a SeedTable (the same bits)."""
    q0 = _quantize(t, 1, op, seed=0, rotation=None, rtne=True)  # an FP4Tensor: its block scales
    unit = block_scales(q0).repeat_interleave(q0.block_len, dim=-1)[: t.shape[0], : t.shape[1]]
    if q0.tensor_scale is not None:
        unit = unit * q0.tensor_scale
    u = (random_bytes(seed, t.numel(), t.device).reshape(t.shape).to(torch.float32) + 0.5) / 256
    return (t.to(torch.float32) + op.dither * unit * (u - 0.5)).to(t.dtype)


def operand_knobs(op: Operand, rotation: Rotation | None = None) -> Mapping[str, object]:
    """The quantizer keywords of op's format (FormatSpec.knobs), from the operand's fields (a
    read-only mapping: callers unpack it)."""
    knobs = _fixed_knobs(op)
    if rotation is None or "hadamard" not in op.format.spec.knobs:
        return knobs
    return {**knobs, "hadamard": rotation.signs, "hadamard_seed": rotation.seed}


@functools.lru_cache(maxsize=256)  # (an operand's own keywords: asked five times an FP4 linear's step)
def _fixed_knobs(op: Operand) -> Mapping[str, object]:
    offered = {"block": (16, 16) if op.block2d else (1, op.format.spec.block_len), "profile": op.profile,
               "mode": op.mx_mode}
    return types.MappingProxyType(op.format.spec.select(offered))


def _quantize(t: torch.Tensor, axis: int, op: Operand, *, seed: int | torch.Tensor, rotation: Rotation | None,
              rtne: bool = False, codes: bool = True) -> FP4Tensor | BlockValues:
    kwargs = dict(axis=axis, rounding="rtne" if rtne else op.rounding, seed=seed, pad=True, **operand_knobs(op, rotation))
    return kernels.quantize_as(t, op.format, **kwargs) if codes else kernels.quantize_values(t, op.format, **kwargs)


def fuses_rotation(op: Operand, rotation: Rotation) -> bool:
    """Whether op's quantizer applies ``rotation`` itself: the rotation is its block size (NVFP4 16,
    MXFP4 32) on an undithered operand."""
    return (op.quantized and "hadamard" in op.format.spec.knobs and rotation.size == op.format.spec.block_len
            and not op.dither)


def quantize_operand(t: torch.Tensor, axis: int, op: Operand, *, seed: int | torch.Tensor, rotation: Rotation | None = None,
                     stats: dict[str, dict[str, float]] | None = None, key: str = "",
                     codes: bool = False) -> torch.Tensor | FP4Tensor | BlockValues:
    """t: [R, L] (axis 1) or [L, R] (axis 0) -> t rotated (if asked) and, unless op is BF16,
    quantized along ``axis``: BlockValues (the GEMM operand), or with ``codes`` the FP4Tensor.
    With ``stats``, records quant_stats of what was quantized at ``key``."""
    # the quantizer rotates by itself when the rotation is its block size
    fused = rotation is not None and stats is None and fuses_rotation(op, rotation)
    if rotation is not None and not fused:
        t = hadamard_transform(t, axis=axis, size=rotation.size, signs=rotation.signs, seed=rotation.seed)
    if not op.quantized:
        return t
    q = _quantize(t, axis, op, seed=seed, rotation=rotation if fused else None, codes=codes or stats is not None)
    if stats is not None:
        stats[key] = quant_stats(t, q)
    return q if codes or stats is None else kernels.to_values(q)  # statistics needed the codes first


def _oriented(t: torch.Tensor, axis: int) -> torch.Tensor:
    """A high-precision operand as a [rows, L] matrix."""
    return t if axis == 1 else t.T


def gemm_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """What an FP4 GEMM writes for ``out_dtype``: float16 goes through float32 (the kernels write
    float32 or bfloat16)."""
    return torch.float32 if out_dtype == torch.float16 else out_dtype


def run_gemm(a: torch.Tensor | BlockValues, a_axis: int, b: torch.Tensor | BlockValues, b_axis: int,
             out_dtype: torch.dtype) -> torch.Tensor:
    """C = A @ B^T: [rows_a, rows_b] ``out_dtype`` from operands as quantize_operand returns them."""
    if isinstance(a, BlockValues) and isinstance(b, BlockValues):
        return kernels.values_mm(a, b, out_dtype=gemm_dtype(out_dtype)).to(out_dtype)
    if not isinstance(a, BlockValues) and not isinstance(b, BlockValues):
        return _oriented(a, a_axis) @ _oriented(b, b_axis).T
    # one side kept BF16: the FP4 side dequantized to fp32, cropped to the BF16 side's true length
    if isinstance(a, BlockValues):
        b_m = _oriented(b, b_axis)
        a_m = a.dense()[:, : b_m.shape[1]]
    else:
        a_m = _oriented(a, a_axis)
        b_m = b.dense()[:, : a_m.shape[1]]
    return (a_m.to(torch.float32) @ b_m.to(torch.float32).T).to(out_dtype)
