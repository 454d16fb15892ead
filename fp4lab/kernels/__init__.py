"""fp4lab.kernels: fast paths with fp4lab.formats' signatures and bytes, chosen per call.

This face owns two choices the layers above never make: the backend, and the operand form.

``Backend`` picks the implementation: AUTO (the default) runs Triton for CUDA tensors and the
reference (fp4lab.formats) for everything else; REFERENCE forces the reference (for debugging);
TRITON forces Triton (CUDA, or any device under TRITON_INTERPRET=1; a dense GEMM on CUDA then runs
on cuBLASLt where it applies, kernels.blas: the same function, another summation order). The
environment variable FP4LAB_BACKEND sets the default. Where Triton is missing, AUTO warns once and uses the reference.
Triton is imported here lazily, so this package imports on a machine without it.

Operand forms (docs/design.md "Operand forms"): a GEMM operand is quantized to ``BlockValues``
(exact bf16 code * block scale and the tensor scale: what BF16 tensor cores multiply), written by
the quantize pass itself on Triton (``quantize_values``; ``quantize_values_pair`` writes a
linear's two copies of one tensor from one read) or decoded from the reference's FP4Tensor
(``to_values``); ``quantize_grouped_values`` quantizes every MoE expert's tensor in one
launch (``GroupedValues``); ``values_mm`` multiplies one pair, ``grouped_values_mm`` one pair per
MoE expert in one launch, and ``contraction_grouped_values_mm`` one pair per expert whose
contraction runs over the expert's own tokens (wgrad), also in one launch. Both backends compute the same function (formats.emulated_mm's): the
same exact products, an FP32 accumulation, alpha once.

Files: elements.py (device functions for codes), quantize.py (NVFP4/MXFP4 quantize, fused
Hadamard), amax.py (tensor amax pass), decode.py (dequantize), gemm.py (emulated FP4 GEMM),
operand.py (BlockValues: a quantized operand decoded for BF16 tensor cores), matmul.py (scaled
BF16 GEMM with alpha in the epilogue, dense and grouped), blas.py (the dense one on cuBLASLt, where
CUDA has it), groups.py (a routing's device counts into the grouped launches' tables, one launch
each), host.py (launch sizing arithmetic).
Speed: benchmarks/README.md; correctness: tests/kernels (bytes equal to fp4lab.formats).

Public: ``Backend``, ``FAST_QUANTIZERS``, ``quantize_as``, ``quantize_nvfp4``, ``quantize_mxfp4``,
``dequantize``, ``fake_quantize``, ``fp4_mm``, ``uses_triton``, ``BlockValues``, ``quantize_values``,
``quantize_values_pair``, ``to_values``, ``values_mm``, ``GroupedValues``, ``TransposedGroups``,
``quantize_grouped_values``,
``quantize_grouped_columns``, ``check_unpadded_rows``,
``grouped_values_mm``, ``contraction_grouped_values_mm``, ``grouped_fp4_mm``.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch

from .. import formats
from ..formats.types import Choice, Format, FP4Tensor
from .host import env
from .operand import BlockValues, GroupedValues, TransposedGroups
from .operand import alpha as operand_alpha


class Backend(Choice):
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


def uses_triton(x: torch.Tensor | torch.device, backend: str | Backend | None = None) -> bool:
    """Whether calls on ``x`` (a tensor, or tensors on a device) run Triton kernels under
    ``backend`` (None: FP4LAB_BACKEND, else auto)."""
    device = x if isinstance(x, torch.device) else x.device
    runs, warning = _backend_rule(backend or env("FP4LAB_BACKEND", "auto"), device.type,
                                  env("TRITON_INTERPRET") == "1")
    if warning:
        _warn_once(warning)
    return runs


@functools.lru_cache(maxsize=64)  # (asked half a dozen times an FP4 linear's step)
def _backend_rule(backend: str | Backend, device_type: str, interpreted: bool) -> tuple[bool, str | None]:
    """uses_triton's answer for a backend name, a device type and the interpreter switch, with
    the warning it gives, if any (errors are raised, and so never cached)."""
    choice = Backend.parse(backend)
    if choice is Backend.REFERENCE:
        return False, None
    has_triton = _triton_installed()
    if choice is Backend.TRITON:
        if not has_triton:
            raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
        if not (device_type == "cuda" or interpreted):
            raise RuntimeError(f"backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1, got {device_type}")
        return True, None
    if device_type == "cuda" and not has_triton:
        return False, "triton is not installed: fp4lab uses its (slow) reference kernels on CUDA"
    return device_type == "cuda", None


@functools.cache
def _triton_installed() -> bool:
    """Whether the triton package is there, asked once (an FP4 linear's step asks half a dozen times)."""
    return importlib.util.find_spec("triton") is not None


FAST_QUANTIZERS: dict[Format, tuple[str, str]] = {
    Format.NVFP4: ("quantize_nvfp4", "nvfp4_block_values"),
    Format.MXFP4: ("quantize_mxfp4", "mxfp4_block_values"),
}
"""Each format's Triton twins in kernels.quantize: (codes and scales, block values)."""


def _fast(fmt: Format, values: bool):
    from . import quantize as triton_quantize  # the submodule (imports triton)
    return getattr(triton_quantize, FAST_QUANTIZERS[fmt][values])


def quantize_as(x: torch.Tensor, fmt: str | Format, *, backend: str | Backend | None = None, **kwargs) -> FP4Tensor:
    """The reference quantizer of ``fmt`` (formats.FORMAT_SPECS) on the chosen backend, with its
    keyword arguments."""
    spec = formats.spec_of(fmt)
    if uses_triton(x, backend):
        return _fast(spec.format, False)(x, **kwargs)
    return spec.quantize(x, **kwargs)


def quantize_nvfp4(x: torch.Tensor, *, backend: str | Backend | None = None, **kwargs) -> FP4Tensor:
    """fp4lab.formats.quantize_nvfp4 on the chosen backend (same keyword arguments)."""
    return quantize_as(x, Format.NVFP4, backend=backend, **kwargs)


def quantize_mxfp4(x: torch.Tensor, *, backend: str | Backend | None = None, **kwargs) -> FP4Tensor:
    """fp4lab.formats.quantize_mxfp4 on the chosen backend (same keyword arguments)."""
    return quantize_as(x, Format.MXFP4, backend=backend, **kwargs)


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


def quantize_values(x: torch.Tensor, fmt: str | Format = Format.NVFP4, *, backend: str | Backend | None = None,
                    **kwargs) -> BlockValues:
    """The quantize of ``fmt`` (formats' keyword arguments) as a GEMM operand: exact bf16 block
    values and the tensor scale, written by the quantize pass itself on the Triton backend."""
    spec = formats.spec_of(fmt)
    if uses_triton(x, backend):
        return _fast(spec.format, True)(x, **kwargs)
    return BlockValues.of(spec.quantize(x, **kwargs))


def quantize_values_pair(x: torch.Tensor, fmt: str | Format, *, rows: dict, columns: dict, columns_len: int,
                         partners: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                         backend: str | Backend | None = None) -> tuple[BlockValues, BlockValues]:
    """The two copies a linear layer quantizes of one [M, K] tensor: (quantize_values(x, fmt,
    axis=1, **rows), quantize_values of x zero-padded to ``columns_len`` rows along axis 0,
    **columns): fprop's and wgrad's operands of an input, dgrad's and wgrad's of a gradient. On
    Triton, where kernels.quantize.pair_refusal allows, each read of x serves both copies (one pass
    for both tensor amaxes, one for both copies); else the two calls. ``partners`` (rows, columns):
    the tensor scale of each copy's GEMM partner, or None; the pair kernel then writes the copy's
    alpha (BlockValues.alpha_with), elsewhere it is left to the GEMM (the same bits)."""
    spec = formats.spec_of(fmt)
    if x.dim() != 2 or columns_len < x.shape[0] or columns_len % spec.block_len:
        raise ValueError(f"quantize_values_pair: x {tuple(x.shape)} needs to be a matrix whose rows, padded to "
                         f"columns_len = {columns_len}, are a whole number of {spec.block_len}-blocks")
    if uses_triton(x, backend):
        from .quantize import try_block_values_pair
        pair = try_block_values_pair(x, spec.format, rows=rows, columns=columns, columns_len=columns_len,
                                     partners=partners)
        if pair is not None:
            return pair
    padded = torch.nn.functional.pad(x, (0, 0, 0, columns_len - x.shape[0])) if columns_len > x.shape[0] else x
    return (quantize_values(x, spec.format, backend=backend, **{"pad": True, **rows, "axis": 1}),
            quantize_values(padded, spec.format, backend=backend, **{"pad": True, **columns, "axis": 0}))


def to_values(q: FP4Tensor, *, backend: str | Backend | None = None) -> BlockValues:
    """A quantized tensor as a GEMM operand (its exact block values), decoded on the chosen backend."""
    if uses_triton(q.codes, backend):
        from .decode import block_values
        return BlockValues.of(q, block_values(q, torch.bfloat16))
    return BlockValues.of(q)


def values_mm(a: BlockValues, b: BlockValues, *, out_dtype: torch.dtype = torch.float32,
              backend: str | Backend | None = None) -> torch.Tensor:
    """C = alpha * (A @ B^T) from two BlockValues along the same K: [a.rows, b.rows] ``out_dtype``.
    Triton: kernels.matmul.scaled_mm (alpha in the epilogue; cuBLASLt for a dense call on CUDA);
    reference: formats.emulated_mm's operations (fp32 matmul of the exact values, then alpha, then
    the cast)."""
    _check_values_pair(a, b)
    if uses_triton(a.values, backend):
        if out_dtype in (torch.float32, torch.bfloat16):
            from .matmul import scaled_mm
            # the two tensor scales go to the GEMM, which multiplies them (the Triton epilogue, with no
            # launch), or their product where a's quantize pass wrote it for b (cuBLASLt takes one alpha)
            scales = None if a.tensor_scale is None or b.tensor_scale is None else (a.tensor_scale, b.tensor_scale)
            written = a.alpha_with
            if scales is not None and written is not None and written[0] is a.tensor_scale \
                    and written[1] is b.tensor_scale:
                scales = written[2]
            return scaled_mm(a.matrix, b.matrix, scales, out_dtype=out_dtype)
        _warn_once(f"fp4lab.kernels.values_mm writes float32 or bfloat16; {out_dtype} runs the reference matmul")
    return ((a.matrix.to(torch.float32) @ b.matrix.to(torch.float32).T) * operand_alpha(a, b)).to(out_dtype)


def _check_values_pair(a: BlockValues, b: BlockValues) -> None:
    if a.values.shape[1] != b.values.shape[1]:
        raise ValueError(f"K mismatch: {tuple(a.values.shape)} and {tuple(b.values.shape)}")
    if a.format is not b.format:
        raise ValueError(f"GEMM operands must share a format, got {a.format} and {b.format}")


def quantize_grouped_values(x: torch.Tensor, fmt: str | Format, sizes: list[int] | torch.Tensor,
                            seeds: list[int] | torch.Tensor, *, backend: str | Backend | None = None,
                            **kwargs) -> GroupedValues:
    """x: [R, L], groups of ``sizes`` rows back to back (each > 0), one seed each -> every group
    quantized along L as quantize_values(x_g, fmt, seed=seeds[g], **kwargs) alone would: one
    Triton launch for all of them (and one grouped amax pass), or a loop on the reference.
    On the Triton path ``sizes`` (then empty groups allowed) and ``seeds`` may be device tensors,
    kept there (quantize.grouped_block_values: what a CUDA graph captures)."""
    spec = formats.spec_of(fmt)
    if uses_triton(x, backend):
        from .quantize import grouped_block_values
        values, scales = grouped_block_values(x, spec.format, _as_given(sizes), _as_given(seeds), **kwargs)
        return GroupedValues(values, scales, _kept(sizes), spec.format)
    sizes, seeds = _listed(sizes), _listed(seeds)
    parts = [BlockValues.of(spec.quantize(xg, axis=1, seed=seed, **kwargs))
             for xg, seed in zip(x.split(sizes), seeds)]
    scales = None if parts[0].tensor_scale is None else torch.stack([p.tensor_scale for p in parts])
    return GroupedValues(torch.cat([p.matrix for p in parts]), scales, tuple(sizes), spec.format)


def _kept(sizes: list[int] | torch.Tensor) -> tuple[int, ...] | torch.Tensor:
    """GroupedValues.sizes: a tuple, or a device tensor kept as it is (never read on the host)."""
    return sizes if isinstance(sizes, torch.Tensor) else tuple(sizes)


def _as_given(values) -> list[int] | torch.Tensor:
    """What the grouped Triton quantizes take: a device tensor as it is (kept there), else a list."""
    return values if isinstance(values, torch.Tensor) else list(values)


def _listed(values: list[int] | torch.Tensor) -> list[int]:
    """Host ints (the reference backend's loop reads them: a tensor is read here)."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def quantize_grouped_columns(x: torch.Tensor, fmt: str | Format, widths: list[int] | torch.Tensor,
                             seeds: list[int] | torch.Tensor, *, hadamard=None,
                             hadamard_seeds: list[int] | torch.Tensor | None = None,
                             rows: list[int] | torch.Tensor | None = None,
                             backend: str | Backend | None = None, **kwargs) -> GroupedValues:
    """x: [S, K], groups of ``widths`` rows back to back (each a positive multiple of 32) ->
    GroupedValues along axis 1 ([K, S]): group g's columns are quantize_values(x_g, fmt, axis=0,
    seed=seeds[g], hadamard=hadamard, hadamard_seed=hadamard_seeds[g], **kwargs) as alone (wgrad's
    operands of MoE experts, their tokens padded per expert): two Triton launches for all of
    them, or a loop on the reference joined by one copy. Device tensors as in
    quantize_grouped_values (widths of 0 allowed on the Triton path). With ``rows`` x holds the
    groups unpadded (rows[g] <= widths[g] each, back to back), each read as if zero-padded to its
    width: the same result with no padded copy of x made first. The padded length is sum(widths);
    under device counts the Triton path's runs on to S + 31 G rounded up to 32
    (quantize.grouped_column_block_values), the reference's stays sum(widths)."""
    spec = formats.spec_of(fmt)
    h_seeds = [0] * len(widths) if hadamard_seeds is None else hadamard_seeds
    if uses_triton(x, backend):  # (which checks ``rows`` itself: the launches read by them)
        from .quantize import grouped_column_block_values
        values, scales = grouped_column_block_values(x, spec.format, _as_given(widths), _as_given(seeds),
                                                     hadamard=hadamard, hadamard_seeds=_as_given(h_seeds),
                                                     rows=None if rows is None else _as_given(rows), **kwargs)
        return GroupedValues(values, scales, _kept(widths), spec.format, axis=1)
    if rows is not None:
        check_unpadded_rows(x.shape[0], rows, widths)
    rotation = {} if hadamard is None else {"hadamard": hadamard}
    widths, seeds, h_seeds = _listed(widths), _listed(seeds), _listed(h_seeds)
    groups = x.split(widths) if rows is None else [  # each group zero-padded to its width here
        torch.nn.functional.pad(xg, (0, 0, 0, w - xg.shape[0])) for xg, w in zip(x.split(_listed(rows)), widths)]
    parts = [BlockValues.of(spec.quantize(xg, axis=0, seed=seed, pad=False, hadamard_seed=h, **rotation, **kwargs))
             for xg, seed, h in zip(groups, seeds, h_seeds)]
    return GroupedValues(torch.cat([p.matrix for p in parts], dim=1), _tensor_scales(parts), tuple(widths),
                         spec.format, axis=1)


def check_unpadded_rows(x_rows: int, rows: list[int] | torch.Tensor, widths: list[int] | torch.Tensor) -> None:
    """quantize_grouped_columns' ``rows``: host ints where ``widths`` are, a device tensor where
    they are one; host rows one per width, each 0 <= rows[g] <= widths[g], x_rows of them in all."""
    if isinstance(rows, torch.Tensor) != isinstance(widths, torch.Tensor):
        raise ValueError("quantize_grouped_columns: rows and widths must both be device tensors or both host ints")
    if isinstance(rows, torch.Tensor):
        return  # (device counts are checked where the launch reads them, never on the host)
    if len(rows) != len(widths):
        raise ValueError(f"quantize_grouped_columns: {len(rows)} rows for {len(widths)} widths")
    if any(not 0 <= n <= w for n, w in zip(rows, widths)):
        raise ValueError(f"quantize_grouped_columns: rows {list(rows)} must each lie in [0, its width] of {list(widths)}")
    if sum(rows) != x_rows:
        raise ValueError(f"quantize_grouped_columns: rows sum to {sum(rows)}, x has {x_rows}")


def grouped_values_mm(a: list[BlockValues] | GroupedValues, b: list[BlockValues] | GroupedValues | TransposedGroups,
                      *, out_dtype: torch.dtype = torch.float32, backend: str | Backend | None = None) -> torch.Tensor:
    """One C_g = alpha_g * (A_g @ B_g^T) per group (MoE experts: a[g] has m_g rows, every b[g]
    the same N rows and K) -> [sum m_g, N] ``out_dtype``: one Triton launch
    (kernels.matmul.grouped_scaled_mm), or values_mm per group on the reference. Groups come as
    lists of BlockValues or as row GroupedValues, taken whole (no per-group views, no copy); B
    also as TransposedGroups, read in place by that launch (else copied first)."""
    if isinstance(b, TransposedGroups):
        if (isinstance(a, GroupedValues) and a.axis == 0 and uses_triton(a.values, backend)
                and out_dtype in (torch.float32, torch.bfloat16)):
            stack = b.of.transposed_stack(b.rows)
            if len(a.sizes) != stack.shape[0] or a.values.shape[1] != stack.shape[2] or a.format is not b.of.format:
                raise ValueError(f"grouped operands do not pair: A {tuple(a.values.shape)} in {len(a.sizes)} groups, "
                                 f"{a.format}; B {tuple(stack.shape)}, {b.of.format}")
            from .matmul import grouped_scaled_mm
            return grouped_scaled_mm(a.values, stack, a.sizes, _alphas(a, b.of), out_dtype=out_dtype)
        b = b.copied()
    if isinstance(a, GroupedValues) and isinstance(b, GroupedValues) and a.axis == b.axis == 0:
        _check_grouped_pair(a, b)
        if (uses_triton(a.values, backend) and out_dtype in (torch.float32, torch.bfloat16)
                and len(set(b.sizes)) == 1):
            from .matmul import grouped_scaled_mm
            return grouped_scaled_mm(a.values, _stacked(b), a.sizes, _alphas(a, b), out_dtype=out_dtype)
    if (isinstance(a, GroupedValues) and a.on_device and not isinstance(b, GroupedValues)
            and uses_triton(a.values, backend) and out_dtype in (torch.float32, torch.bfloat16)):
        # the rows' counts on the device (never read here), each B listed: stacked in one copy
        from .matmul import grouped_scaled_mm
        if any(vb.values.shape[1] != a.values.shape[1] or vb.format is not a.format for vb in b):
            raise ValueError(f"grouped operands do not pair: A {tuple(a.values.shape)} {a.format}, B "
                             f"{[(tuple(vb.values.shape), vb.format.value) for vb in b]}")
        return grouped_scaled_mm(a.values, torch.stack([v.matrix for v in b]), a.sizes, _alphas(a, b),
                                 out_dtype=out_dtype)
    a_list, b_list = _groups(a), _groups(b)
    if len(a_list) != len(b_list) or not a_list:
        raise ValueError(f"grouped_values_mm takes as many A as B operands (at least one), got {len(a_list)} "
                         f"and {len(b_list)}")
    for va, vb in zip(a_list, b_list):
        _check_values_pair(va, vb)
    if uses_triton(a_list[0].values, backend) and out_dtype in (torch.float32, torch.bfloat16):
        from .matmul import grouped_scaled_mm
        a_rows = a.values if isinstance(a, GroupedValues) and a.axis == 0 else torch.cat([v.matrix for v in a_list])
        b_stack = _stacked(b) if isinstance(b, GroupedValues) else torch.stack([v.matrix for v in b_list])
        return grouped_scaled_mm(a_rows, b_stack, [va.rows for va in a_list], _alphas(a, b), out_dtype=out_dtype)
    return torch.cat([values_mm(va, vb, out_dtype=out_dtype, backend=Backend.REFERENCE)
                      for va, vb in zip(a_list, b_list)])


def contraction_grouped_values_mm(a: list[BlockValues] | GroupedValues, b: list[BlockValues] | GroupedValues, *,
                                  out_dtype: torch.dtype = torch.float32,
                                  backend: str | Backend | None = None) -> torch.Tensor:
    """One C_g = alpha_g * (A_g @ B_g^T) per group, every a[g] the same M rows and every b[g] the
    same N rows, the contraction length each group's own (MoE wgrad: each expert's padded tokens)
    -> [G, M, N] ``out_dtype``, each C_g what values_mm(a[g], b[g]) gives: one Triton launch
    (kernels.matmul.contraction_grouped_mm; column GroupedValues, as quantize_grouped_columns
    writes them, and listed groups that are column slices of one buffer are read in place), or
    values_mm per group on the reference."""
    if isinstance(a, GroupedValues) and isinstance(b, GroupedValues) and a.axis == b.axis == 1:
        _check_grouped_pair(a, b)
        if uses_triton(a.values, backend) and out_dtype in (torch.float32, torch.bfloat16):
            from .matmul import contraction_grouped_mm
            from .quantize import COL_GROUP_WIDTH
            # device widths are whole column tiles of the grouped quantize (trusted, as the counts
            # are); listed ones the launcher measures itself
            multiple = COL_GROUP_WIDTH if a.on_device and a.values.shape[1] % COL_GROUP_WIDTH == 0 else 1
            return contraction_grouped_mm(a.values, b.values, a.sizes, _alphas(a, b), out_dtype=out_dtype,
                                          width_multiple=multiple)
    a, b = _groups(a), _groups(b)
    if len(a) != len(b) or not a:
        raise ValueError(f"contraction_grouped_values_mm takes as many A as B operands (at least one), got {len(a)} "
                         f"and {len(b)}")
    for va, vb in zip(a, b):
        _check_values_pair(va, vb)
    if len({v.rows for v in a}) != 1 or len({v.rows for v in b}) != 1:
        raise ValueError("contraction_grouped_values_mm takes groups of the same rows (only the contraction varies), "
                         f"got {[v.rows for v in a]} and {[v.rows for v in b]}")
    if uses_triton(a[0].values, backend) and out_dtype in (torch.float32, torch.bfloat16):
        from .matmul import contraction_grouped_mm
        return contraction_grouped_mm(_joined_columns(a), _joined_columns(b), [v.values.shape[1] for v in a],
                                      _alphas(a, b), out_dtype=out_dtype)
    return torch.stack([values_mm(va, vb, out_dtype=out_dtype, backend=Backend.REFERENCE) for va, vb in zip(a, b)])


def _stacked(b: GroupedValues) -> torch.Tensor:
    """[G, N, Lp]: row groups of one size N as a stack (a view where they are, else one copy)."""
    if b.axis == 0 and len(set(b.sizes)) == 1:
        return b.values.view(len(b.sizes), b.sizes[0], b.values.shape[1])
    return torch.stack([v.matrix for v in b.groups()])


def _check_grouped_pair(a: GroupedValues, b: GroupedValues) -> None:
    """What _check_values_pair asks of every group's pair, asked once of two GroupedValues along
    the same axis: as many groups, one format, one contraction length per group (device sizes:
    the same tensor, as they are never read on the host)."""
    if a.axis == 0:
        same = a.values.shape[1] == b.values.shape[1]
    else:
        same = a.sizes is b.sizes if a.on_device or b.on_device else a.sizes == b.sizes
    if a.axis != b.axis or len(a.sizes) != len(b.sizes) or not len(a.sizes) or not same:
        raise ValueError(f"grouped operands do not pair: {len(a.sizes)} and {len(b.sizes)} groups, "
                         f"values {tuple(a.values.shape)} and {tuple(b.values.shape)} along axis {a.axis}")
    if a.format is not b.format:
        raise ValueError(f"GEMM operands must share a format, got {a.format} and {b.format}")


def _joined_columns(ops: list[BlockValues]) -> torch.Tensor:
    """[rows, sum of widths]: the groups' matrices side by side, read in place where each group's
    columns follow the previous group's in one buffer (else one copy)."""
    first = ops[0].matrix
    width, size = first.shape[1], first.element_size()
    for v in ops[1:]:
        m = v.matrix
        if (m.stride() != first.stride() or m.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or m.data_ptr() != first.data_ptr() + width * first.stride(1) * size):
            return torch.cat([v.matrix for v in ops], dim=1)
        width += m.shape[1]
    return first.as_strided((first.shape[0], width), first.stride())


def _groups(ops: list[BlockValues] | GroupedValues) -> list[BlockValues]:
    return ops.groups() if isinstance(ops, GroupedValues) else list(ops)


def _tensor_scales(ops: list[BlockValues] | GroupedValues) -> torch.Tensor | None:
    """[G] fp32: every group's S_dec as one tensor, or None where some group has none."""
    if isinstance(ops, GroupedValues):
        return ops.tensor_scales
    scales = [v.tensor_scale for v in ops]
    return None if any(s is None for s in scales) else torch.stack(scales)


def _alphas(a: list[BlockValues] | GroupedValues, b: list[BlockValues] | GroupedValues) -> torch.Tensor:
    """[G] fp32 S_dec_A,g * S_dec_B,g (operand.alpha per group) in one multiply where every group
    has both scales, ones where a side has none (MXFP4), else per group."""
    a_scales, b_scales = _tensor_scales(a), _tensor_scales(b)
    if a_scales is not None and b_scales is not None:
        return a_scales * b_scales
    if any(isinstance(ops, GroupedValues) and ops.tensor_scales is None for ops in (a, b)):  # MXFP4, no listing
        values = a.values if isinstance(a, GroupedValues) else a[0].values
        return torch.ones(len(a.sizes) if isinstance(a, GroupedValues) else len(a), dtype=torch.float32,
                          device=values.device)
    a_list, b_list = _groups(a), _groups(b)
    if all(v.tensor_scale is None for v in a_list) or all(v.tensor_scale is None for v in b_list):
        return torch.ones(len(a_list), dtype=torch.float32, device=a_list[0].values.device)
    return torch.stack([operand_alpha(va, vb) for va, vb in zip(a_list, b_list)])


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
    return dequantize(quantize_as(x, fmt, backend=backend, **kwargs), x.dtype, backend=backend)
