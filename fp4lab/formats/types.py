"""The named numerics choices (enums) and the quantized-tensor dataclass ``FP4Tensor``.

Every choice where published sources disagree is an enum member whose docstring states the
formula and its source; functions accept the enum or its string value (``"te"``, ``"rceil"``),
and anything else is a ``ValueError`` that lists the valid names.

``FP4Tensor`` memory layout: the block axis is moved last, so quantizing ``x: [M, K]`` along
axis 1 stores ``codes: [M, K/2]`` and along axis 0 stores ``codes: [K, M/2]`` (TE's columnwise
copy). ``scales`` holds one byte per block along that last axis (``[.., L/16]`` for NVFP4,
``[.., L/32]`` for MXFP4; 16x16 weight tiles replicate their scale into all 16 rows), or, when
``scale_layout`` is ``SWIZZLED``, the flat byte buffer of layout.py's 128x4 layout.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass

import torch


class Choice(str, enum.Enum):
    """A named choice: an enum whose members are also their string names (as configs spell them)."""

    @classmethod
    def parse(cls, value: "str | Choice") -> "Choice":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"unknown {cls.__name__} {value!r}; expected one of {names}") from None

    def __str__(self) -> str:
        return self.value


class Format(Choice):
    """The number format of a tensor or GEMM operand. The block-scaled ones have an entry in
    spec.FORMAT_SPECS (``fmt.spec``), which holds everything that differs between them."""

    BF16 = "bf16"
    """Not quantized: the tensor as it is (in a GEMM, the compute dtype)."""
    NVFP4 = "nvfp4"
    """E2M1 elements, 16-element blocks, E4M3 block scale, FP32 tensor scale."""
    MXFP4 = "mxfp4"
    """E2M1 elements, 32-element blocks, UE8M0 (power of two) block scale, no tensor scale."""

    @property
    def quantized(self) -> bool:
        return self is not Format.BF16

    @property
    def spec(self):
        """-> spec.FormatSpec (ValueError for BF16)."""
        return _spec_of()(self)


@functools.cache
def _spec_of():
    """spec.spec_of, imported on first use (the table imports the quantizers, which import this
    module), then kept: an import statement in ``Format.spec`` cost each of an FP4 linear's dozen
    calls a step a trip through the import system."""
    from .spec import spec_of
    return spec_of


class Rounding(Choice):
    RTNE = "rtne"
    """Round to nearest, ties to even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4)."""
    STOCHASTIC = "stochastic"
    """Round |x| up with probability ceil(256 * frac) / 256, frac = (|x| - lo) / (hi - lo): the
    8-random-bit semantics of Blackwell's cvt.rs.satfinite.e2m1x4.f32; bits from rng.py."""


class NVFP4Profile(Choice):
    TE = "te"
    """TransformerEngine / torchao training: S_enc = 2688 / amax (FLT_MAX-clamped, 1 if amax is 0),
    s_b = e4m3(min(block_amax * (S_enc * fp32(1/6)), 448)) with no lower clamp,
    elements x * min(1 / (fp32(s_b) * S_dec), FLT_MAX)."""
    TORCHAO = "torchao"
    """torchao 0.18 nvfp4_quantize (PTQ): per_tensor_scale = amax / 2688,
    s_b = e4m3(clamp((block_amax / 6) / per_tensor_scale, 2^-6, 448)),
    elements x * ((1 / per_tensor_scale) / fp32(s_b))."""
    FOUR_OVER_SIX = "four_over_six"
    """Four Over Six (arXiv 2512.02010): te's arithmetic with S_enc = 1536 / amax (6 * 256, so a
    block scaled to 4 still fits E4M3), and each block (16x16 tile) scaled so its amax maps to 6
    or to 4, whichever round-to-nearest quantization has the smaller squared error
    (formats/nvfp4.py gives the exact order of operations)."""


class MXScaleMode(Choice):
    FLOOR = "floor"
    """OCP MX v1.0: e = floor(log2(amax)) - 2. Can clip: amax 7.9 -> 2^0 -> 7.9 saturates to 6."""
    CEIL = "ceil"
    """e = ceil(log2(amax)) - 2: never clips, but wastes range when amax is a power of two."""
    EVEN = "even"
    """Round amax to E2M1's one mantissa bit (half up), then floor (microxcaling / torchao EVEN)."""
    RCEIL = "rceil"
    """e = ceil(log2(fp32(amax * fp32(1/6)))): the smallest scale that keeps amax <= 6 * 2^e
    (cuBLAS / NVIDIA conversions, ModelOpt)."""


class ScaleLayout(Choice):
    PLAIN = "plain"
    """scales[..., j] is block j of the row, row-major."""
    SWIZZLED = "swizzled"
    """cuBLAS 128x4 / CUTLASS SfKMajorAtom, flat bytes, zero padded (layout.py)."""


@dataclass(frozen=True, kw_only=True)
class FP4Tensor:
    """A tensor quantized to 4-bit codes with block scales. Dequantize with ``dequantize(q)``."""

    codes: torch.Tensor
    """[*lead, Lp // 2] uint8, two E2M1 codes per byte, element 2i in the low nibble."""
    scales: torch.Tensor
    """[*lead, Lp // block_len] of the format's scale_dtype (spec.FORMAT_SPECS); flat if swizzled."""
    tensor_scale: torch.Tensor | None
    """[] float32 decode multiplier S_dec where the format has one (NVFP4), else None."""
    shape: torch.Size
    """Logical shape of the source tensor (before moving the axis and padding)."""
    axis: int
    """Non-negative index of the quantized (block) axis in ``shape``."""
    block: tuple[int, int]
    """(1, 16), (16, 16) for 2D NVFP4 weight tiles, or (1, 32) for MXFP4."""
    format: Format
    rounding: Rounding
    profile: NVFP4Profile | None = None
    """NVFP4 only."""
    mx_mode: MXScaleMode | None = None
    """MXFP4 only."""
    scale_layout: ScaleLayout = ScaleLayout.PLAIN

    def __post_init__(self) -> None:
        # accept the string names too, and check what a hand-built tensor could get wrong
        for name, kind in (("format", Format), ("rounding", Rounding), ("scale_layout", ScaleLayout),
                           ("profile", NVFP4Profile), ("mx_mode", MXScaleMode)):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, kind.parse(value))
        object.__setattr__(self, "shape", torch.Size(self.shape))
        if self.codes.dtype != torch.uint8:
            raise TypeError(f"codes must be packed uint8, got {self.codes.dtype}")
        spec = self.format.spec
        if self.block not in spec.blocks:
            raise ValueError(f"{self.format} blocks are {spec.blocks}, got {self.block}")
        scale_dtype = spec.scale_dtype
        if self.scales.dtype != scale_dtype:
            raise TypeError(f"{self.format} scales must be {scale_dtype}, got {self.scales.dtype}")

    def to(self, device: torch.device | str) -> "FP4Tensor":
        """The same tensor with its codes and scales on ``device``."""
        scale = None if self.tensor_scale is None else self.tensor_scale.to(device)
        return dataclasses.replace(self, codes=self.codes.to(device), scales=self.scales.to(device),
                                   tensor_scale=scale)

    @property
    def block_len(self) -> int:
        """Elements per block along the quantized axis."""
        return self.block[1]

    @property
    def lead_shape(self) -> torch.Size:
        """Shape of the stored rows: ``shape`` without the quantized axis (padded for 16x16)."""
        return self.codes.shape[:-1]

    @property
    def padded_len(self) -> int:
        """Stored length of the quantized axis (a multiple of ``block_len``)."""
        return self.codes.shape[-1] * 2
