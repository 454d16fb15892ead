"""What NVFP4 and MXFP4 quantization share: input checks, moving the block axis last, padding,
per-block amax (1xN rows or 16x16 tiles), non-finite blocks and stochastic-rounding bytes.

Non-finite input (the policy of both formats and every profile, tested): a block that holds a
NaN or an Inf is not representable, so its scale byte becomes the scale format's NaN (E4M3 0x7F,
UE8M0 0xFF) and its codes 0; it dequantizes to NaN, visibly and locally. Tensor amax and block
amax are taken over finite values only, so the rest of the tensor quantizes as if those blocks
were absent. (TE's kernels instead let an Inf drive amax to Inf, which collapses S_enc to 1 for
the whole tensor; torchao lets NaN reach every scale. Neither is worth matching bit for bit.)

Public: ``check_input``, ``prepare``, ``blocks_of``, ``block_amax``, ``stochastic_bytes``, ``restore``.
"""

from __future__ import annotations

import torch

from .rng import check_seed_tensor, random_bytes
from .types import Rounding

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_input(x: torch.Tensor, axis: int, block: tuple[int, int], pad: bool) -> tuple[int, list[int]]:
    """Validate a block-quantization request -> (axis >= 0, zero padding [quantized axis, other])."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"FP4 quantization takes float32, bfloat16 or float16 input, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("cannot block-quantize a 0-d tensor; reshape it to [1] first")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} out of range for a tensor of shape {tuple(x.shape)}")
    axis %= x.dim()
    rows, cols = block
    if rows != 1 and x.dim() != 2:
        raise ValueError(f"{rows}x{cols} blocks need a 2D tensor, got shape {tuple(x.shape)}")
    pads = [_padding(x.shape[axis], cols, "quantized axis", x.shape, axis, pad), 0]
    if rows != 1:
        pads[1] = _padding(x.shape[1 - axis], rows, "other axis", x.shape, axis, pad)
    return axis, pads


def prepare(x: torch.Tensor, axis: int, block: tuple[int, int], pad: bool) -> tuple[torch.Tensor, int]:
    """x: [...] float -> (xm: [*lead, Lp] float32 with the block axis last and padded, axis >= 0).

    2D blocks (16x16) need a 2D x; both dimensions are then padded (or must divide) by 16.
    """
    axis, pads = check_input(x, axis, block, pad)
    xm = x.movedim(axis, -1).to(torch.float32)
    if any(pads):
        xm = torch.nn.functional.pad(xm, [0, pads[0]] + ([0, pads[1]] if block[0] != 1 else []))
    return xm.contiguous(), axis


def _padding(length: int, block: int, what: str, shape: torch.Size, axis: int, pad: bool) -> int:
    extra = -length % block
    if extra and not pad:
        raise ValueError(f"{what} of length {length} (shape {tuple(shape)}, axis {axis}) is not "
                         f"divisible by the block size {block}; pass pad=True to zero-pad it")
    return extra


def blocks_of(xm: torch.Tensor, block_len: int) -> torch.Tensor:
    """xm: [*lead, Lp] -> [*lead, Lp / block_len, block_len] view."""
    return xm.reshape(*xm.shape[:-1], xm.shape[-1] // block_len, block_len)


def block_amax(xb: torch.Tensor, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """xb: [*lead, nb, n] float32 -> (amax over finite values, holds-a-non-finite) each [*lead, nb].

    tile_rows 16 takes one amax per 16x16 tile (xb is [R, nb, 16]) and replicates it to all 16 rows.
    """
    finite = torch.isfinite(xb)
    mag = torch.where(finite, xb.abs(), 0.0)
    amax = mag.amax(dim=-1) if xb.shape[-1] else mag.sum(dim=-1)
    bad = (~finite).any(dim=-1)
    if tile_rows != 1:
        r, nb = amax.shape
        amax = amax.reshape(r // tile_rows, tile_rows, nb).amax(dim=1).repeat_interleave(tile_rows, 0)
        bad = bad.reshape(r // tile_rows, tile_rows, nb).any(dim=1).repeat_interleave(tile_rows, 0)
    return amax, bad


def finite_amax(xm: torch.Tensor) -> torch.Tensor:
    """xm: [...] float32 -> [] float32 max |x| over finite values (0 for empty or all non-finite)."""
    mag = torch.where(torch.isfinite(xm), xm.abs(), 0.0)
    return mag.amax() if mag.numel() else torch.zeros((), device=xm.device)


def resolve_seed(seed: int | torch.Generator | torch.Tensor | None) -> int:
    """An explicit int, a torch.Generator, a one-element int64 tensor holding the seed (a device
    seed, which the kernels read at launch: read here, a host sync), or None (draw from torch's
    default CPU generator)."""
    if isinstance(seed, torch.Tensor):
        return int(check_seed_tensor(seed).item())
    if isinstance(seed, bool) or not isinstance(seed, (int, torch.Generator, type(None))):
        raise TypeError(f"seed must be an int, a torch.Generator, an int64 tensor or None, got {type(seed).__name__}")
    if isinstance(seed, int):
        return seed
    device = seed.device if seed is not None else "cpu"
    return int(torch.randint(0, 2**62, (), generator=seed, dtype=torch.int64, device=device))


def seed_key(seed: int | torch.Generator | torch.Tensor | None,
             device: torch.device | str | None = None) -> int | torch.Tensor:
    """The key Philox draws from (random_bytes, the kernels): a seed tensor as it is, moved to
    ``device`` if given (never read on the host, so a CUDA graph captures the draw and replays it
    with the slot's later values), anything else resolve_seed's int."""
    if isinstance(seed, torch.Tensor):
        check_seed_tensor(seed)
        return seed if device is None else seed.to(device)
    return resolve_seed(seed)


def stochastic_bytes(rounding: Rounding, seed: int | torch.Generator | torch.Tensor | None,
                     xm: torch.Tensor) -> torch.Tensor | None:
    """Random bytes for stochastic rounding in the stored [*lead, Lp] layout (None for RTNE)."""
    if rounding is Rounding.RTNE:
        return None
    return random_bytes(seed_key(seed, xm.device), xm.numel(), xm.device).reshape(xm.shape)


def restore(xm: torch.Tensor, shape: torch.Size, axis: int) -> torch.Tensor:
    """Inverse of ``prepare``: crop padding from [*lead, Lp] and move the last axis back."""
    moved = list(shape)
    moved.append(moved.pop(axis))
    crop = xm[tuple(slice(0, n) for n in moved)]
    return crop.movedim(-1, axis)
