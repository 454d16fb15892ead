"""fp4lab.kernels: fast paths with fp4lab.formats' signatures and bytes, chosen per call.

``Backend`` picks the implementation: AUTO (the default) runs Triton for CUDA tensors and the
reference (fp4lab.formats) for everything else; REFERENCE forces the reference (for debugging);
TRITON forces Triton (CUDA, or any device under TRITON_INTERPRET=1). The environment variable
FP4LAB_BACKEND sets the default. Where Triton is missing, AUTO warns once and uses the reference.
Triton is imported here lazily, so this package imports on a machine without it.

Files: elements.py (device functions for codes), quantize.py (NVFP4/MXFP4 quantize, fused
Hadamard), amax.py (tensor amax pass), decode.py (dequantize), gemm.py (emulated FP4 GEMM),
operand.py (BlockValues: a quantized operand decoded for BF16 tensor cores), matmul.py (scaled
BF16 GEMM with alpha in the epilogue, dense and grouped).
Speed: benchmarks/README.md; correctness: tests/kernels (bytes equal to fp4lab.formats).

Public: ``Backend``, ``quantize_nvfp4``, ``quantize_mxfp4``, ``dequantize``, ``fake_quantize``,
``fp4_mm``, ``uses_triton``, ``BlockValues``, ``quantize_values``, ``values_mm``, ``grouped_fp4_mm``.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from .. import formats
from ..formats.types import FP4Tensor, _Choice
from .operand import BlockValues
from .operand import alpha as operand_alpha


class Backend(_Choice):
    AUTO = "auto"
    """Triton for CUDA tensors, the reference otherwise."""
    REFERENCE = "reference"
    """fp4lab.formats, on any device."""
    TRITON = "triton"
    """fp4lab.kernels' Triton kernels (CUDA, or TRITON_INTERPRET=1)."""


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def uses_triton(x: torch.Tensor, backend: str | Backend | None = None) -> bool:
    """Whether calls on ``x`` run Triton kernels under ``backend`` (None: FP4LAB_BACKEND, else auto)."""
    choice = Backend.parse(backend or os.environ.get("FP4LAB_BACKEND", "auto"))
    if choice is Backend.REFERENCE:
        return False
    has_triton = importlib.util.find_spec("triton") is not None
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if choice is Backend.TRITON:
        if not has_triton:
            raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
        if not (x.is_cuda or interpreted):
            raise RuntimeError(f"backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1, got {x.device}")
        return True
    if x.is_cuda and not has_triton:
        _warn_once("triton is not installed: fp4lab uses its (slow) reference kernels on CUDA")
        return False
    return x.is_cuda


def quantize_nvfp4(x: torch.Tensor, *, backend: str | Backend | None = None, **kwargs) -> FP4Tensor:
    """fp4lab.formats.quantize_nvfp4 on the chosen backend (same keyword arguments)."""
    if uses_triton(x, backend):
        from .quantize import quantize_nvfp4 as fast
        return fast(x, **kwargs)
    return formats.quantize_nvfp4(x, **kwargs)


def quantize_mxfp4(x: torch.Tensor, *, backend: str | Backend | None = None, **kwargs) -> FP4Tensor:
    """fp4lab.formats.quantize_mxfp4 on the chosen backend (same keyword arguments)."""
    if uses_triton(x, backend):
        from .quantize import quantize_mxfp4 as fast
        return fast(x, **kwargs)
    return formats.quantize_mxfp4(x, **kwargs)


def dequantize(q: FP4Tensor, dtype: torch.dtype = torch.float32, *,
               backend: str | Backend | None = None) -> torch.Tensor:
    """fp4lab.formats.dequantize on the chosen backend."""
    if uses_triton(q.codes, backend):
        from .decode import dequantize as fast
        return fast(q, dtype)
    return formats.dequantize(q, dtype)


def fp4_mm(qa: FP4Tensor, qb: FP4Tensor, *, out_dtype: torch.dtype = torch.float32,
           backend: str | Backend | None = None, **kwargs) -> torch.Tensor:
    """C = A @ B^T from FP4 operands (formats.gemm's conventions): Triton/cuBLAS on CUDA
    (kernels.gemm.fp4_mm, ``method=`` "auto" | "decoded" | "fused" | "two_stage"; auto is decoded
    on CUDA), formats.emulated_mm otherwise."""
    if uses_triton(qa.codes, backend):
        from .gemm import fp4_mm as fast
        return fast(qa, qb, out_dtype=out_dtype, **kwargs)
    return formats.emulated_mm(qa, qb, out_dtype=out_dtype)


def quantize_values(x: torch.Tensor, fmt: str = "nvfp4", *, backend: str | Backend | None = None,
                    **kwargs) -> BlockValues:
    """The quantize of ``fmt`` (formats' keyword arguments) as a GEMM operand: exact bf16 block
    values and the tensor scale, written by the quantize pass itself on the Triton backend."""
    nvfp4 = formats.Format.parse(fmt) is formats.Format.NVFP4
    if uses_triton(x, backend):
        from .quantize import mxfp4_block_values, nvfp4_block_values
        return (nvfp4_block_values if nvfp4 else mxfp4_block_values)(x, **kwargs)
    return BlockValues.of((formats.quantize_nvfp4 if nvfp4 else formats.quantize_mxfp4)(x, **kwargs))


def values_mm(a: BlockValues, b: BlockValues, *, out_dtype: torch.dtype = torch.float32,
              backend: str | Backend | None = None) -> torch.Tensor:
    """C = alpha * (A @ B^T) from two BlockValues along the same K: [a.rows, b.rows] ``out_dtype``.
    Triton: kernels.matmul.scaled_mm (alpha in the epilogue); reference: formats.emulated_mm's
    operations (fp32 matmul of the exact values, then alpha, then the cast)."""
    if a.values.shape[1] != b.values.shape[1]:
        raise ValueError(f"K mismatch: {tuple(a.values.shape)} and {tuple(b.values.shape)}")
    if (a.tensor_scale is None) != (b.tensor_scale is None):  # NVFP4 carries a tensor scale, MXFP4 none
        raise ValueError("values_mm operands must share a format (one is NVFP4, the other MXFP4)")
    scale = operand_alpha(a, b)
    if uses_triton(a.values, backend):
        if out_dtype in (torch.float32, torch.bfloat16):
            from .matmul import scaled_mm
            return scaled_mm(a.matrix, b.matrix, scale, out_dtype=out_dtype)
        _warn_once(f"fp4lab.kernels.values_mm writes float32 or bfloat16; {out_dtype} runs the reference matmul")
    return ((a.matrix.to(torch.float32) @ b.matrix.to(torch.float32).T) * scale).to(out_dtype)


def grouped_fp4_mm(qa, qb, *, out_dtype: torch.dtype = torch.bfloat16,
                   backend: str | Backend | None = None) -> torch.Tensor:
    """One C_g = A_g @ B_g^T per group (lists of FP4Tensors, variable rows m_g) -> [sum m_g, N]:
    one Triton launch (kernels.gemm.grouped_fp4_mm), or fp4_mm per group on the reference."""
    if qa and uses_triton(qa[0].codes, backend):
        from .gemm import grouped_fp4_mm as fast
        return fast(qa, qb, out_dtype=out_dtype)
    if len(qa) != len(qb) or not qa:
        raise ValueError(f"grouped_fp4_mm takes as many A as B operands (at least one), got {len(qa)} and {len(qb)}")
    return torch.cat([formats.emulated_mm(a, b, out_dtype=out_dtype) for a, b in zip(qa, qb)])


def fake_quantize(x: torch.Tensor, fmt: str = "nvfp4", *, backend: str | Backend | None = None,
                  **kwargs) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype and shape: what an FP4 GEMM operand really holds."""
    quantize = quantize_nvfp4 if formats.Format.parse(fmt) is formats.Format.NVFP4 else quantize_mxfp4
    return dequantize(quantize(x, backend=backend, **kwargs), x.dtype, backend=backend)
