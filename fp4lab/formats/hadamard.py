"""Blockwise Hadamard transforms, the rotation that spreads outliers before FP4 quantization.

H_n is the Sylvester Hadamard matrix, H[i, j] = (-1)^popcount(i & j), scaled by 1/sqrt(n) so it
is orthonormal; n = 16 (NVFP4 blocks, TE) or 32 (MXFP4 blocks, Quartet). With a sign vector s,
the rotation is M = diag(s) @ H_n / sqrt(n), applied to each run of n consecutive elements v along
``axis`` as a row vector: v -> v @ M (flip the signs, then mix). Sign choices (HadamardSigns):

    none    s = 1: the deterministic Hadamard (stabilised MXFP4 Wgrad on MI355X)
    te      TE's one fixed vector for every layer (16 entries)
    random  s_i = 1 - 2 * (Philox byte i of ``seed`` & 1): redraw per step by changing the seed

Because M is orthogonal, applying it along the token axis to both operands of the Wgrad GEMM
cancels: (dY^T M)(M^T X)... written per chunk, sum_c dY_c^T M M^T X_c = dY^T X.

Determinism: the product is computed with the fast Walsh-Hadamard butterfly, log2(n) stages of
(a + b, a - b) in fp32 in a fixed order, then one multiply by fp32(1/sqrt(n)) (exact for n = 16),
then one rounding to ``dtype`` (bf16 for bf16 input, as TE rounds the transformed tensor before
quantizing). So every device gives the same bits. A tensor-core matmul sums in another order and
agrees except when a chunk's fp32 sums are inexact (elements whose exponents span > ~15 binades).

Public: ``HadamardSigns``, ``TE_SIGNS``, ``hadamard_signs``, ``hadamard_matrix``, ``hadamard_transform``.
"""

from __future__ import annotations

import math

import torch

from .blocks import seed_key
from .rng import random_bytes
from .types import Choice

TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
SIZES = (16, 32)


class HadamardSigns(Choice):
    NONE = "none"
    """All +1: the plain (deterministic) Hadamard."""
    TE = "te"
    """TransformerEngine's fixed 16-entry sign vector, shared by all layers."""
    RANDOM = "random"
    """Signs from Philox bits of an explicit seed (bit 0 of byte i for sign i)."""


def hadamard_signs(size: int, signs: str | HadamardSigns = HadamardSigns.NONE,
                   seed: int | torch.Generator | torch.Tensor | None = None) -> torch.Tensor:
    """-> [size] float32 of +-1 (on a seed tensor's device, else the CPU)."""
    if size not in SIZES:
        raise ValueError(f"Hadamard size must be one of {SIZES}, got {size}")
    signs = HadamardSigns.parse(signs)
    if signs is HadamardSigns.NONE:
        return torch.ones(size)
    if signs is HadamardSigns.TE:
        if size != len(TE_SIGNS):
            raise ValueError(f"TE's sign vector has {len(TE_SIGNS)} entries; size {size} needs "
                             "signs='none' or 'random'")
        return torch.tensor(TE_SIGNS, dtype=torch.float32)
    bits = random_bytes(seed_key(seed), size).to(torch.float32)  # (a device seed drawn where it lives)
    return 1.0 - 2.0 * (bits % 2)


def _butterfly(v: torch.Tensor) -> torch.Tensor:
    """v: [..., n] float32 -> v @ H_n (unscaled), in the fixed butterfly order."""
    n = v.shape[-1]
    h = 1
    while h < n:
        pairs = v.reshape(*v.shape[:-1], n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = torch.stack([a + b, a - b], dim=-2).reshape(*v.shape[:-1], n)
        h *= 2
    return v


def hadamard_matrix(size: int = 16, signs: str | HadamardSigns = HadamardSigns.NONE,
                    seed: int | torch.Generator | None = None) -> torch.Tensor:
    """-> [size, size] float32 M = diag(s) @ H / sqrt(size), so that v -> v @ M."""
    return hadamard_transform(torch.eye(size), size=size, signs=signs, seed=seed)


def hadamard_transform(x: torch.Tensor, *, axis: int = -1, size: int = 16,
                       signs: str | HadamardSigns = HadamardSigns.NONE,
                       seed: int | torch.Generator | None = None,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [...] float -> [...] ``dtype`` (default x.dtype): each run of ``size`` elements along
    ``axis`` mapped v -> v @ diag(s) @ H / sqrt(size). The axis length must divide by ``size``."""
    if not x.is_floating_point():
        raise TypeError(f"hadamard_transform takes a float tensor, got {x.dtype}")
    if x.dim() == 0 or not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} out of range for a tensor of shape {tuple(x.shape)}")
    s = hadamard_signs(size, signs, seed).to(x.device)
    if x.shape[axis] % size:
        raise ValueError(f"axis {axis} of shape {tuple(x.shape)} has length {x.shape[axis]}, "
                         f"not divisible by the Hadamard size {size}")
    xm = x.movedim(axis, -1).to(torch.float32)
    chunks = xm.reshape(*xm.shape[:-1], xm.shape[-1] // size, size) * s
    scale = torch.tensor(1 / math.sqrt(size), dtype=torch.float32, device=x.device)
    y = (_butterfly(chunks) * scale).reshape(xm.shape)
    return y.movedim(-1, axis).to(dtype or x.dtype)
