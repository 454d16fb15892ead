"""One GEMM of a recipe: rotate, dither and quantize its operands, then multiply.

``quantize_operand`` turns a 2D operand into what the GEMM consumes, following its
recipe.Operand field by field:

    rotate    hadamard_transform along the contraction axis (both operands, so it cancels),
              rounded to the operand's dtype as TE does; fused into the NVFP4 quantize when the
              size is 16 (same bytes: the quantizer rotates the same way)
    dither    (weights) t + dither * unit * (u - 1/2), unit = the element's block scale times
              the tensor scale from an RTNE quantization of t, u from Philox bytes of the seed
    quantize  fp4lab.kernels.quantize_nvfp4 / quantize_mxfp4 (Triton on CUDA, the reference
              otherwise), padded to the block size

On the Triton backend, when both operands of a GEMM are FP4, the quantize writes BlockValues
(exact bf16 code * block scale) instead of codes, and kernels.values_mm multiplies them.

``run_gemm`` multiplies the two: both FP4 -> kernels.fp4_mm (code * block scale in BF16, FP32
accumulation, alpha once; on CPU formats.emulated_mm); both dense -> a plain matmul in their
dtype (what nn.Linear does); mixed (one side kept BF16) -> the FP4 side dequantized, an FP32
matmul. Operands are given with their contraction axis: A [rows_a, L] (axis 1) or its
transpose [L, rows_a] (axis 0), likewise B; the result is [rows_a, rows_b].

Seeds: ``derive_seed(root, *parts)`` (SplitMix64 over the parts) gives every stochastic choice
its own stream from the recipe seed, the layer, the step and the GEMM, so runs replay exactly
and nothing draws from torch's global generator.

Public: ``Rotation``, ``derive_seed``, ``rotation_for``, ``quantize_operand``, ``run_gemm``,
``dither``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import kernels
from ..kernels import BlockValues
from ..formats import FP4Tensor, hadamard_transform, quant_stats, random_bytes
from ..formats.dequantize import block_scales
from ..formats.hadamard import HadamardSigns
from .recipe import GemmSpec, HadamardMode, Operand, Precision

_MASK64 = (1 << 64) - 1
FIXED_SIGNS_TAG = 0x51C7


def derive_seed(*parts: int) -> int:
    """-> a seed in [0, 2**63) from integer parts (SplitMix64 finalizer folded over them)."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (part & _MASK64)) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


class Rotation(NamedTuple):
    """A concrete Hadamard rotation: sign rule, size, and the seed for random signs."""

    signs: HadamardSigns
    size: int
    seed: int = 0


def rotation_for(spec: GemmSpec, root: int, step_seed: int) -> Rotation | None:
    """The rotation ``spec`` asks for; ``step_seed`` re-draws RANDOM signs (per layer and step)."""
    if spec.hadamard is HadamardMode.NONE:
        return None
    if spec.hadamard is HadamardMode.DETERMINISTIC:
        return Rotation(HadamardSigns.NONE, spec.hadamard_size)
    if spec.hadamard is HadamardMode.FIXED and spec.hadamard_size == 16:
        return Rotation(HadamardSigns.TE, 16)
    seed = derive_seed(root, FIXED_SIGNS_TAG) if spec.hadamard is HadamardMode.FIXED else step_seed
    return Rotation(HadamardSigns.RANDOM, spec.hadamard_size, seed)


def dither(t: torch.Tensor, op: Operand, seed: int) -> torch.Tensor:
    """t: [N, K] weight -> t + op.dither * unit * (u - 1/2) in t's dtype (see the module doc)."""
    q0 = _quantize(t, 1, op, seed=0, rotation=None, rtne=True)
    unit = block_scales(q0).repeat_interleave(q0.block_len, dim=-1)[: t.shape[0], : t.shape[1]]
    if q0.tensor_scale is not None:
        unit = unit * q0.tensor_scale
    u = (random_bytes(seed, t.numel(), t.device).reshape(t.shape).to(torch.float32) + 0.5) / 256
    return (t.to(torch.float32) + op.dither * unit * (u - 0.5)).to(t.dtype)


def _quantize(t: torch.Tensor, axis: int, op: Operand, *, seed: int, rotation: Rotation | None,
              rtne: bool = False, values: bool = False) -> FP4Tensor | BlockValues:
    rounding = "rtne" if rtne else op.rounding
    if op.format is Precision.NVFP4:
        extra = {} if rotation is None else {"hadamard": rotation.signs, "hadamard_seed": rotation.seed}
        kwargs = dict(axis=axis, block=(16, 16) if op.block2d else 16, rounding=rounding, seed=seed,
                      profile=op.profile, pad=True, **extra)
        return kernels.quantize_values(t, "nvfp4", **kwargs) if values else kernels.quantize_nvfp4(t, **kwargs)
    kwargs = dict(axis=axis, mode=op.mx_mode, rounding=rounding, seed=seed, pad=True)
    return kernels.quantize_values(t, "mxfp4", **kwargs) if values else kernels.quantize_mxfp4(t, **kwargs)


def quantize_operand(t: torch.Tensor, axis: int, op: Operand, *, seed: int, rotation: Rotation | None = None,
                     stats: dict[str, dict[str, float]] | None = None, key: str = "",
                     values: bool = False) -> torch.Tensor | FP4Tensor | BlockValues:
    """t: [R, L] (axis 1) or [L, R] (axis 0) -> t rotated (if asked) and, unless op is BF16,
    quantized along ``axis``: an FP4Tensor, or with ``values`` its BlockValues written by the
    quantize itself (the same operand, ready for BF16 tensor cores). With ``stats``, records
    quant_stats of what was quantized at ``key`` (an FP4Tensor then)."""
    fused = (rotation is not None and op.format is Precision.NVFP4 and rotation.size == 16
             and stats is None and not op.dither)
    if rotation is not None and not fused:
        t = hadamard_transform(t, axis=axis, size=rotation.size, signs=rotation.signs, seed=rotation.seed)
    if not op.quantized:
        return t
    q = _quantize(t, axis, op, seed=seed, rotation=rotation if fused else None, values=values and stats is None)
    if stats is not None:
        stats[key] = quant_stats(t, q)
    return q


def _dense(v: torch.Tensor | FP4Tensor, axis: int) -> torch.Tensor:
    """An operand as a [rows, L] matrix (FP4 dequantized to fp32)."""
    if isinstance(v, FP4Tensor):
        v = kernels.dequantize(v, torch.float32)
    return v if axis == 1 else v.T


def run_gemm(a: torch.Tensor | FP4Tensor, a_axis: int, b: torch.Tensor | FP4Tensor, b_axis: int,
             out_dtype: torch.dtype) -> torch.Tensor:
    """C = A @ B^T: [rows_a, rows_b] ``out_dtype`` from operands as quantize_operand returns them
    (BlockValues come in pairs)."""
    if isinstance(a, BlockValues) and isinstance(b, BlockValues):
        out = kernels.values_mm(a, b, out_dtype=torch.float32 if out_dtype == torch.float16 else out_dtype)
        return out.to(out_dtype)
    if isinstance(a, FP4Tensor) and isinstance(b, FP4Tensor):
        out = kernels.fp4_mm(a, b, out_dtype=torch.float32 if out_dtype == torch.float16 else out_dtype)
        return out.to(out_dtype)
    if isinstance(a, FP4Tensor) or isinstance(b, FP4Tensor):
        return (_dense(a, a_axis).to(torch.float32) @ _dense(b, b_axis).to(torch.float32).T).to(out_dtype)
    return _dense(a, a_axis) @ _dense(b, b_axis).T
