"""fp4lab.formats: the bit-exact reference for FP4 numerics, in plain PyTorch (CPU and GPU).

Every fast path in fp4lab.kernels must reproduce these functions byte for byte. Files:
codes.py (E2M1 / E4M3 / UE8M0), rng.py (Philox bits for stochastic rounding), nvfp4.py,
mxfp4.py, dequantize.py, layout.py (swizzled scales), hadamard.py, gemm.py (reference scaled
GEMM), stats.py (quantization error statistics), types.py (named choices, FP4Tensor), spec.py
(the format table: what differs between NVFP4 and MXFP4).
"""

from .codes import (decode_e2m1, decode_e4m3, decode_ue8m0, encode_e2m1, encode_e4m3, encode_ue8m0,
                    pack_nibbles, unpack_nibbles)
from .dequantize import block_scales, block_values, dequantize
from .gemm import emulated_mm, gemm_alpha, scaled_mm
from .hadamard import HadamardSigns, hadamard_matrix, hadamard_signs, hadamard_transform
from .layout import swizzle_scales, swizzled_offset, unswizzle_scales, with_scale_layout
from .mxfp4 import quantize_mxfp4
from .nvfp4 import quantize_nvfp4
from .rng import random_bytes
from .stats import quant_stats
from .spec import FORMAT_SPECS, FormatSpec, spec_of
from .types import Choice, Format, FP4Tensor, MXScaleMode, NVFP4Profile, Rounding, ScaleLayout

__all__ = [
    "Choice", "FORMAT_SPECS", "FormatSpec", "spec_of", "FP4Tensor", "Format", "MXScaleMode", "NVFP4Profile", "Rounding", "ScaleLayout",
    "HadamardSigns", "block_scales", "block_values", "emulated_mm", "gemm_alpha", "hadamard_matrix",
    "hadamard_signs", "hadamard_transform", "quant_stats", "scaled_mm", "decode_e2m1", "decode_e4m3", "decode_ue8m0", "dequantize", "encode_e2m1",
    "encode_e4m3", "encode_ue8m0", "pack_nibbles", "quantize_mxfp4", "quantize_nvfp4",
    "random_bytes", "swizzle_scales", "swizzled_offset", "unpack_nibbles", "unswizzle_scales",
    "with_scale_layout",
]
