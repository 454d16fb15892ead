"""BlockValues: an FP4 GEMM operand decoded for Hopper's BF16 tensor cores.

An emulated FP4 GEMM multiplies code * block scale, which is exact in BF16 (a 2-bit by 4-bit
significand, or code * 2^e for MXFP4), and applies the tensor scales' product once at the end
(formats.gemm.emulated_mm). When an operand is quantized only to be multiplied, writing those
values straight from the quantize pass (kernels.quantize.nvfp4_block_values) saves writing the
packed codes and reading them back.

    values        [R, Lp] bf16, the stored layout of the quantized tensor (block axis last;
                  R counts 16x16 padding rows too)
    tensor_scale  [] fp32 S_dec where the format has one (NVFP4), else None
    rows          how many of the R rows hold data
    format        the block format the values came from
    alpha_with    None, or (S_dec, t, S_dec * t): the product of this operand's tensor scale and
                  t, the tensor scale of the operand its GEMM multiplies it with, written by the
                  pass that wrote S_dec (kernels.values_mm takes it as the GEMM's alpha where this
                  operand's tensor_scale is still S_dec and the other's is t, both the same tensors:
                  no launch for the product)

``GroupedValues`` holds the operands of a grouped GEMM's groups (MoE experts) as one tensor,
their rows (or, for wgrad, their columns) back to back, with one tensor scale per group: what one
quantize launch writes for all of them (``groups()`` gives each as BlockValues, views of the same
memory). The grouped GEMMs take it whole: no per-expert objects on the host.

Public: ``BlockValues``, ``GroupedValues``, ``TransposedGroups``, ``device_counts``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import formats
from ..formats.types import Format, FP4Tensor


class BlockValues(NamedTuple):
    values: torch.Tensor
    tensor_scale: torch.Tensor | None
    rows: int
    format: Format
    alpha_with: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, q: FP4Tensor, values: torch.Tensor | None = None) -> "BlockValues":
        """The block values of a quantized tensor: ``values`` if decoded already (a kernel's
        [*lead, Lp] bf16), else the reference's decode."""
        if values is None:
            values = formats.block_values(q).to(torch.bfloat16)
        rows = math.prod(size for i, size in enumerate(q.shape) if i != q.axis)
        return cls(values.reshape(-1, q.padded_len), q.tensor_scale, rows, q.format)

    @property
    def matrix(self) -> torch.Tensor:
        """[rows, Lp] bf16: the data rows."""
        return self.values if self.rows == self.values.shape[0] else self.values[: self.rows]

    def dense(self) -> torch.Tensor:
        """[rows, Lp] fp32: the dequantized tensor in the stored layout (padding columns are 0)."""
        values = self.matrix.to(torch.float32)
        return values if self.tensor_scale is None else values * self.tensor_scale

    def transposed(self, rows: int) -> "BlockValues":
        """The same values with rows and columns swapped, ``rows`` of them holding data: a 16x16-
        tiled tensor read along its other axis has the same tiles and tensor scale, so these are
        exactly its block values (what quantizing along the other axis would give)."""
        return BlockValues(self.values.T, self.tensor_scale, rows, self.format)


@dataclass(frozen=True)
class GroupedValues:
    values: torch.Tensor
    """Every group's block values in one bf16 tensor, the groups back to back along ``axis``."""
    tensor_scales: torch.Tensor | None
    """[G] fp32 S_dec per group (NVFP4), else None."""
    sizes: tuple[int, ...] | torch.Tensor
    """Each group's rows (axis 0) or columns (axis 1): host ints, or a device tensor of them (a
    routing's counts, never read on the host: groups() and transposed() read them)."""
    format: Format
    axis: int = 0
    """0: group g is rows sizes[:g].sum() onwards of values [sum(sizes), Lp] (fprop's and dgrad's
    operands, blocks along each row); 1: group g is columns sizes[:g].sum() onwards of values
    [rows, sum(sizes)], every group holding all rows (wgrad's operands, blocks along the tokens)."""

    @property
    def on_device(self) -> bool:
        return isinstance(self.sizes, torch.Tensor)

    def groups(self) -> list[BlockValues]:
        """Each group's operand (views, no copy; device sizes are read here)."""
        out, start = [], 0
        for g, size in enumerate(self.sizes.tolist() if self.on_device else self.sizes):
            scale = None if self.tensor_scales is None else self.tensor_scales[g]
            if self.axis == 0:
                out.append(BlockValues(self.values[start: start + size], scale, size, self.format))
            else:
                out.append(BlockValues(self.values[:, start: start + size], scale, self.values.shape[0], self.format))
            start += size
        return out

    def transposed(self, rows: int) -> "GroupedValues":
        """Every group's BlockValues.transposed(rows) as one GroupedValues (one copy): row groups of
        one size n (a stack of 16x16-tiled [n, Lp] weights) -> groups of ``rows`` rows and n columns,
        what dgrad multiplies (an MoE projection's weights read along their other axis)."""
        stack = self.transposed_stack(rows)
        g, _, n = stack.shape
        return GroupedValues(stack.reshape(g * rows, n), self.tensor_scales, (rows,) * g, self.format)

    def transposed_stack(self, rows: int) -> torch.Tensor:
        """transposed(rows)'s groups as a [G, rows, n] view of these values (no copy): each group's
        B read N-major, as the grouped GEMM can (TransposedGroups)."""
        if self.axis != 0 or len(set(self.sizes)) != 1:
            raise ValueError(f"transposed takes row groups of one size, got axis {self.axis}, sizes {self.sizes}")
        g, n = len(self.sizes), self.sizes[0]
        return self.values.view(g, n, self.values.shape[1]).transpose(1, 2)[:, :rows]


@dataclass(frozen=True)
class TransposedGroups:
    """``of.transposed(rows)`` not yet copied: row groups of one size (an MoE projection's 16x16-tiled
    weights) read along their other axis, as dgrad multiplies them. kernels.grouped_values_mm reads
    them in place, saving a strided copy of every expert's weights per backward; anything else
    asks for ``copied()``."""
    of: GroupedValues
    rows: int

    def copied(self) -> GroupedValues:
        return self.of.transposed(self.rows)


def alpha(a: BlockValues, b: BlockValues) -> torch.Tensor:
    """[] fp32 S_dec_A * S_dec_B, 1 for MXFP4 (formats.gemm.gemm_alpha)."""
    if a.tensor_scale is None or b.tensor_scale is None:
        return torch.ones((), dtype=torch.float32, device=a.values.device)
    return a.tensor_scale * b.tensor_scale


def device_counts(counts: torch.Tensor, groups: int | None, device: torch.device, what: str) -> torch.Tensor:
    """A grouped launch's row counts kept on the device (a routing's), checked in form only: a 1-D
    int32/int64 tensor of ``groups`` entries (one or more if None) on ``device``. Reading their
    values would sync the host, so the launches trust them."""
    if counts.dim() != 1 or not counts.numel() or groups not in (None, counts.numel()) or counts.device != device \
            or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what} as a tensor must be {groups or 'one or more'} int32/int64 counts on {device}, got "
                         f"{tuple(counts.shape)} {counts.dtype} on {counts.device}")
    return counts
