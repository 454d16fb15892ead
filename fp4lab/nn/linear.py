"""The FP4 linear layer: one autograd.Function with three labelled GEMMs, each as the recipe says.

    forward   fprop  y  = x @ W^T        x along K, W along K (16x16 tiles for NVIDIA's recipe)
    backward  dgrad  dx = dy @ W         dy along N, W along N (the columnwise copy)
              wgrad  dW = dy^T @ x       dy and x along M (tokens), rotated when asked

Every operand is quantized from the high-precision tensor (quant.quantize_operand), never from
another quantized copy: that is TE's rowwise / columnwise scheme, and with 16x16 RTNE weight
tiles fprop's and dgrad's W hold exactly the same values (tested); on the Triton backend dgrad
then multiplies fprop's BlockValues transposed instead of quantizing W again. A dithered weight is
dithered once per call and both GEMMs quantize the same dithered tensor. Master weights stay in
their dtype (FP32); the GEMMs run in the compute dtype (bf16 under autocast, as nn.Linear);
weight and bias gradients come back in the parameters' dtype through autograd's casts. For the
Wgrad GEMM the token axis is zero-padded to a multiple of 32 (zero rows add nothing to dy^T x).

``QuantContext`` is the small mutable state a trainer shares with every FP4 layer of a model:
the step ``tick`` (seeds stochastic rounding, random signs and dither, so a resumed run replays
exactly), the training ``progress`` (for ``bf16_after``), and operand statistics collection.

Public: ``QuantContext``, ``FP4Linear``, ``fp4_linear``, ``fprop_weight``.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..formats import FP4Tensor, Rounding
from ..kernels import BlockValues
from .quant import derive_seed, dither, quantize_operand, rotation_for, run_gemm
from .recipe import GEMMS, Recipe

WGRAD_ROW_MULTIPLE = 32  # lcm of the block sizes (16, 32) and Hadamard sizes (16, 32)


@dataclass
class QuantContext:
    """State shared by a model's FP4 layers; the trainer advances it."""

    tick: int = 0
    """Micro-batch counter (step * accumulation + micro): seeds every random choice."""
    progress: float = 0.0
    """Fraction of training done, in [0, 1]: selects ``Recipe.at_progress``."""
    collect: bool = False
    """Record quant_stats of every quantized operand into ``stats`` (costs a sync per operand)."""
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    """'<layer>.<gemm>.<a|b>' -> formats.quant_stats of that operand, from the last call."""
    rank: int = 0
    """Data-parallel rank. Ranks > 0 fold it into every seed: with one stream on all ranks, the
    stochastic-rounding noise of their gradient shards would be correlated, and DDP's average
    would not shrink it as a single GPU's larger batch does. Rank 0 keeps single-GPU seeds."""


@dataclass(frozen=True)
class _Call:
    """What one forward call needs: the recipe in force, the seeds' root, where stats go."""

    recipe: Recipe
    name: str
    root: int  # derive_seed(recipe.seed, layer, tick)
    stats: dict[str, dict[str, float]] | None

    def seed(self, gemm: str, side: str) -> int:
        return derive_seed(self.root, GEMMS.index(gemm), ord(side))

    def operand(self, t: torch.Tensor, axis: int, gemm: str, side: str):
        spec = self.recipe.gemm(gemm)
        rotation = rotation_for(spec, self.recipe.seed, derive_seed(self.root, GEMMS.index(gemm), ord("h")))
        stats_key = f"{self.name}.{gemm}.{side}"
        return quantize_operand(t, axis, getattr(spec, side), seed=self.seed(gemm, side), rotation=rotation,
                                stats=self.stats, key=stats_key, values=self.as_values(t, gemm))

    def as_values(self, t: torch.Tensor, gemm: str) -> bool:
        """Quantize straight to BlockValues: on the Triton backend, for a GEMM with two FP4 operands."""
        spec = self.recipe.gemm(gemm)
        return spec.a.quantized and spec.b.quantized and self.stats is None and kernels.uses_triton(t)

    def dgrad_reuses_fprop_weight(self) -> bool:
        """fprop's and dgrad's weight operands are the same 16x16 RTNE tiles of the same tensor, so
        dgrad can multiply fprop's BlockValues transposed instead of quantizing W again."""
        f, d = self.recipe.fprop, self.recipe.dgrad
        return (f.b == d.b and f.b.block2d and f.b.rounding is Rounding.RTNE and not f.rotated and not d.rotated
                and d.a.quantized)


class _FP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, call: _Call):
        # x: [M, K], weight: [N, K], bias: [N] | None, all in the compute dtype -> y: [M, N]
        fprop = call.recipe.fprop
        w_src = dither(weight, fprop.b, call.seed("fprop", "d")) if fprop.b.dither else weight
        # ---- fprop: y = x @ W^T, contraction over K
        w_fprop = None
        if fprop.quantized or fprop.rotated:
            w_fprop = call.operand(w_src, 1, "fprop", "b")
            y = run_gemm(call.operand(x, 1, "fprop", "a"), 1, w_fprop, 1, x.dtype)
            y = y if bias is None else y + bias
        else:
            y = F.linear(x, w_src, bias)
        ctx.save_for_backward(x, weight, w_src if w_src is not weight else None)
        ctx.call, ctx.has_bias = call, bias is not None
        reuse = isinstance(w_fprop, BlockValues) and call.dgrad_reuses_fprop_weight() and ctx.needs_input_grad[0]
        ctx.w_values = w_fprop if reuse else None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, w_src = ctx.saved_tensors
        w_src = weight if w_src is None else w_src
        call: _Call = ctx.call
        dgrad, wgrad = call.recipe.dgrad, call.recipe.wgrad
        dx = dw = db = None
        # ---- dgrad: dx = dy @ W, contraction over N
        if ctx.needs_input_grad[0]:
            if dgrad.quantized or dgrad.rotated:
                w_op = ctx.w_values
                if w_op is not None and call.as_values(dy, "dgrad"):
                    w_op = w_op.transposed(weight.shape[1])
                else:
                    w_op = call.operand(w_src, 0, "dgrad", "b")
                dx = run_gemm(call.operand(dy, 1, "dgrad", "a"), 1, w_op, 0, dy.dtype)
            else:
                dx = dy.mm(weight)
        # ---- wgrad: dW = dy^T @ x, contraction over M (tokens)
        if ctx.needs_input_grad[1]:
            if wgrad.quantized or wgrad.rotated:
                dy_m, x_m = _pad_rows(dy), _pad_rows(x)
                dw = run_gemm(call.operand(dy_m, 0, "wgrad", "a"), 0, call.operand(x_m, 0, "wgrad", "b"), 0, dy.dtype)
            else:
                dw = dy.t().mm(x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    extra = -t.shape[0] % WGRAD_ROW_MULTIPLE
    return F.pad(t, (0, 0, 0, extra)) if extra else t


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would compute in: autocast's when it is on for x's device, else x's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def layer_key(name: str) -> int:
    """A stable integer per module name: seeds differ per layer and survive reordering."""
    return zlib.crc32(name.encode())


def _call(recipe: Recipe, name: str, context: QuantContext) -> _Call:
    parts = (recipe.seed, layer_key(name), context.tick) + ((context.rank,) if context.rank else ())
    return _Call(recipe=recipe.at_progress(context.progress), name=name, root=derive_seed(*parts),
                 stats=context.stats if context.collect else None)


def fprop_weight(weight: torch.Tensor, recipe: Recipe, *, name: str,
                 context: QuantContext) -> FP4Tensor | None:
    """weight: [N, K] -> the FP4Tensor fprop multiplies now (dither included), None if BF16."""
    call = _call(recipe, name, dataclasses.replace(context, collect=False))
    spec = call.recipe.fprop.b
    if not spec.quantized:
        return None
    w = dither(weight, spec, call.seed("fprop", "d")) if spec.dither else weight
    return call.operand(w, 1, "fprop", "b")


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe, *,
               name: str = "linear", context: QuantContext | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K], bias: [N] | None -> [..., N], the three GEMMs per ``recipe``."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x of shape {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    context = context or QuantContext()
    dtype = compute_dtype(x)
    call = _call(recipe, name, context)
    x2d = x.reshape(-1, x.shape[-1]).to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        y = _FP4LinearFn.apply(x2d, weight.to(dtype), None if bias is None else bias.to(dtype), call)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class FP4Linear(nn.Linear):
    """nn.Linear whose three GEMMs follow a recipe; same parameters and state-dict keys."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Recipe,
                 name: str = "linear", context: QuantContext | None = None, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe, self.name = recipe, name
        self.context = context or QuantContext()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, *, name: str,
                    context: QuantContext) -> "FP4Linear":
        """Wrap ``linear``'s own parameters (no copy: optimizer state and tying survive)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.recipe, layer.name, layer.context = recipe, name, context
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp4_linear(x, self.weight, self.bias, self.recipe, name=self.name, context=self.context)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"
