"""Triton tensor amax over finite values (formats.blocks.finite_amax), as its own fast pass.

Each program reduces a chunk to one value and folds it in with an atomic max on the fp32 bit
pattern: non-negative floats order like their int32 bits, and max is order-independent, so the
result is deterministic and exactly the reference's.

Public: ``finite_amax``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .elements import widen


@triton.jit
def _finite_amax_kernel(x_ptr, out_ptr, n, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = widen(tl.load(x_ptr + offs, mask=offs < n, other=0), BF16_BITS)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bits = tl.where(bits < 0x7F800000, bits, 0)  # NaN and Inf do not count
    tl.atomic_max(out_ptr, tl.max(bits, axis=0))


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """x: [...] float -> [] float32 max |x| over finite elements (0 when there are none)."""
    flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
    out = torch.zeros(1, dtype=torch.int32, device=x.device)
    if flat.numel():
        block = 4096
        bf16 = flat.dtype == torch.bfloat16
        _finite_amax_kernel[(triton.cdiv(flat.numel(), block),)](flat.view(torch.int16) if bf16 else flat, out,
                                                                 flat.numel(), BF16_BITS=bf16, BLOCK=block)
    return out.view(torch.float32).reshape(())
