"""MXFP4 (OCP Microscaling v1.0): E2M1 elements in 32-element blocks, a UE8M0 scale per block.

The scale is a pure power of two 2^e, so scaling an element (x / 2^e) is exact and all rounding
happens in the E2M1 encode. The only choice is the exponent e, computed from the block's amax
with exact bit extraction (codes.floor_log2 / ceil_log2), never float log2. E2M1's largest
power of two is 4 = 2^2 (emax = 2), hence the "- 2"::

    floor  e = floor(log2(amax)) - 2          OCP v1.0; amax in (6, 8) * 2^k clips to 6 * 2^k
    ceil   e = ceil(log2(amax)) - 2           never clips
    even   e = floor(log2(round_1bit(amax))) - 2, rounding amax's mantissa to one bit half-up
           (mantissa >= 1.75 moves to the next binade)
    rceil  e = ceil(log2(fp32(amax * fp32(1/6))))   smallest 2^e with amax <= 6 * 2^e (NVIDIA)
    then   e = clamp(e, -127, 127);  all-zero block -> e = -127 (byte 0x00)
    code   = e2m1(x * 2^-e)   (RTNE or stochastic), saturating at +-6
    scale byte = e + 127; a block holding NaN or Inf -> 0xFF (see blocks.py), codes 0

Differences from torchao's to_mx: torchao saturates Inf inside a finite scale; here a
non-finite block is NaN. The floor/even/ceil/rceil formulas are the same.

Public: ``quantize_mxfp4``.
"""

from __future__ import annotations

import torch

from .blocks import block_amax, blocks_of, check_input, prepare, stochastic_bytes
from .codes import UE8M0_NAN, ceil_log2, decode_ue8m0, encode_e2m1, encode_ue8m0, floor_log2, pack_nibbles
from .hadamard import hadamard_transform
from .types import Format, FP4Tensor, MXScaleMode, Rounding

MX_BLOCK = 32


def mx_exponent(amax: torch.Tensor, mode: MXScaleMode) -> torch.Tensor:
    """amax: [...] float32 >= 0, finite -> [...] int64 unbiased scale exponent in [-127, 127]."""
    zero = amax == 0
    safe = torch.where(zero, 1.0, amax)
    if mode is MXScaleMode.FLOOR:
        e = floor_log2(safe) - 2
    elif mode is MXScaleMode.CEIL:
        e = ceil_log2(safe) - 2
    elif mode is MXScaleMode.EVEN:
        mantissa = safe.to(torch.float64).view(torch.int64) & ((1 << 52) - 1)
        e = floor_log2(safe) + (mantissa >= 3 << 50).to(torch.int64) - 2  # 1.75 and above round up
    else:
        sixth = torch.tensor(1 / 6, dtype=torch.float32, device=amax.device)
        e = ceil_log2(torch.where(zero, 1.0, safe * sixth))
    return torch.where(zero, -127, e.clamp(-127, 127))


def quantize_mxfp4(x: torch.Tensor, *, axis: int = -1, mode: str | MXScaleMode = MXScaleMode.FLOOR,
                   rounding: str | Rounding = Rounding.RTNE,
                   seed: int | torch.Generator | None = None, pad: bool = False,
                   hadamard: str | None = None, hadamard_seed: int | torch.Generator | None = None) -> FP4Tensor:
    """x: [...] float32/bf16/fp16 -> FP4Tensor with codes [*lead, L/2], uint8 scales [*lead, L/32].

    axis: the contraction axis (stored last). mode: "floor" | "ceil" | "even" | "rceil".
    rounding / seed: as in quantize_nvfp4. pad: zero-pad the quantized axis to 32.
    hadamard / hadamard_seed: rotate x first by the 32-point transform, one block at a time
    (signs "none" or "random" from the seed), rounded to x's dtype, as quantize_nvfp4 does at 16.
    """
    mode = MXScaleMode.parse(mode)
    rounding = Rounding.parse(rounding)
    if hadamard is not None:
        check_input(x, axis, (1, MX_BLOCK), pad)  # report the caller's shape before the transform's
        x = hadamard_transform(x, axis=axis, size=MX_BLOCK, signs=hadamard, seed=hadamard_seed)
    xm, axis = prepare(x, axis, (1, MX_BLOCK), pad)
    xb = blocks_of(xm, MX_BLOCK)  # [*lead, nb, 32]
    b_amax, bad = block_amax(xb, 1)
    scales = encode_ue8m0(mx_exponent(b_amax, mode))
    inverse = decode_ue8m0(254 - scales)  # 2^-e exactly, as fp32
    scaled = torch.clamp(xb * inverse[..., None], -6.0, 6.0).reshape(xm.shape)
    codes = encode_e2m1(scaled, stochastic_bytes(rounding, seed, xm))
    codes = torch.where(bad[..., None], 0, blocks_of(codes, MX_BLOCK)).reshape(xm.shape)
    scales = torch.where(bad, UE8M0_NAN, scales).to(torch.uint8)
    return FP4Tensor(codes=pack_nibbles(codes), scales=scales, tensor_scale=None,
                     shape=x.shape, axis=axis, block=(1, MX_BLOCK), format=Format.MXFP4,
                     rounding=rounding, mx_mode=mode)
