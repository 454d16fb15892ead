"""The format table: what each block-scaled FP4 format is, in one place.

Everything that differs between NVFP4 and MXFP4 (docs/numerics.md "NVFP4", "MXFP4") is a field
of its ``FormatSpec``; code elsewhere reads the field instead of testing which format it holds.
Adding a format or a variant is one entry here, its reference quantizer, its Triton twin
(kernels.quantize, registered in kernels.FAST_QUANTIZERS) and their tests.

    field           NVFP4                      MXFP4
    block_len       16                         32
    blocks          (1, 16), (16, 16)          (1, 32)
    scale_dtype     float8_e4m3fn              uint8 (UE8M0)
    decode_scale    codes.decode_e4m3          codes.decode_ue8m0
    scale_nan_byte  0x7F                       0xFF
    scale_one_byte  0x38 (1.0)                 127 (2^0)
    tensor_scale    FP32 S_dec                 none
    quantize        nvfp4.quantize_nvfp4       mxfp4.quantize_mxfp4
    knobs           block, profile, global_    mode, hadamard(_seed)
                    amax, hadamard(_seed)      (32-point)

Public: ``FormatSpec``, ``FORMAT_SPECS``, ``spec_of``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .codes import E4M3_NAN, UE8M0_NAN, decode_e4m3, decode_ue8m0
from .mxfp4 import MX_BLOCK, quantize_mxfp4
from .nvfp4 import quantize_nvfp4
from .types import Format


@dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """One block-scaled FP4 format: E2M1 elements, and how its blocks are scaled."""

    format: Format
    block_len: int
    """Elements per block along the quantized (contraction) axis."""
    blocks: tuple[tuple[int, int], ...]
    """Block shapes the format allows: (rows, block_len); (16, 16) tiles are NVFP4 weights."""
    scale_dtype: torch.dtype
    """How a stored block scale is typed (FP4Tensor.scales)."""
    decode_scale: Callable[[torch.Tensor], torch.Tensor]
    """Stored scale bytes -> float32 block scales."""
    scale_nan_byte: int
    """The scale byte of a block that held Inf or NaN."""
    scale_one_byte: int
    """The scale byte that decodes to 1.0."""
    tensor_scale: bool
    """Whether an FP32 per-tensor decode scale S_dec multiplies every block (alpha in a GEMM)."""
    quantize: Callable[..., object]
    """The reference quantizer: (x, *, axis, rounding, seed, pad, **knobs) -> FP4Tensor."""
    knobs: tuple[str, ...]
    """The quantizer's keywords beyond the common ones: the format's own choices."""

    def select(self, offered: dict[str, object]) -> dict[str, object]:
        """The entries of ``offered`` that are this format's knobs: a caller describes every
        choice it has once, and each format takes its own."""
        return {name: value for name, value in offered.items() if name in self.knobs}


FORMAT_SPECS: dict[Format, FormatSpec] = {
    Format.NVFP4: FormatSpec(format=Format.NVFP4, block_len=16, blocks=((1, 16), (16, 16)),
                             scale_dtype=torch.float8_e4m3fn, decode_scale=decode_e4m3, scale_nan_byte=E4M3_NAN,
                             scale_one_byte=0x38, tensor_scale=True, quantize=quantize_nvfp4,
                             knobs=("block", "profile", "global_amax", "hadamard", "hadamard_seed")),
    Format.MXFP4: FormatSpec(format=Format.MXFP4, block_len=MX_BLOCK, blocks=((1, MX_BLOCK),),
                             scale_dtype=torch.uint8, decode_scale=decode_ue8m0, scale_nan_byte=UE8M0_NAN,
                             scale_one_byte=127, tensor_scale=False, quantize=quantize_mxfp4,
                             knobs=("mode", "hadamard", "hadamard_seed")),
}


def spec_of(fmt: str | Format) -> FormatSpec:
    """The table entry of a block-scaled format (``ValueError`` for bf16 or an unknown name)."""
    fmt = Format.parse(fmt)
    if fmt not in FORMAT_SPECS:
        raise ValueError(f"{fmt} is not a block-scaled FP4 format; expected one of "
                         f"{', '.join(str(f) for f in FORMAT_SPECS)}")
    return FORMAT_SPECS[fmt]
