"""The FP4 linear layer, dense and grouped: the three GEMMs of nn.gemms under a recipe.

    fp4_linear           x: [..., K], W: [N, K]            one layer (FP4Linear's forward)
    grouped_fp4_linear   x: [S, K] sorted by expert, W: [E, N, K]   an MoE projection

Both make the operands of nn.gemms.fp4_gemms, the one three-GEMM body (through the custom ops of
nn.ops when torch.compile traces them); a grouped projection's
expert e is the layer f"{name}.{e}.{label}", with that layer's seeds and tensor scales, so it
computes what a loop of fp4_linear calls over the experts would (fprop and dgrad of all experts
in one launch on the Triton backend). Master weights stay in their dtype (FP32); the GEMMs run
in the compute dtype (bf16 under autocast, as nn.Linear); weight and bias gradients come back in
the parameters' dtype through autograd's casts.

Public: ``QuantContext``, ``FP4Linear``, ``fp4_linear``, ``grouped_fp4_linear``, ``fprop_weight``,
``layer_key``, ``layer_keys``, ``expert_names``, ``compute_dtype``, ``traced_path``, ``slot_arguments``.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from ..formats import FP4Tensor
from .gemms import QuantContext, compute_dtype, fp4_gemms, layer_calls, layer_key, make_call
from .ops import LayerKeys, RecipeSlot, as_recipe, fp4_gemms_op
from .recipe import Recipe

__all__ = ["QuantContext", "FP4Linear", "fp4_linear", "grouped_fp4_linear", "fprop_weight", "layer_key", "layer_keys",
           "expert_names", "compute_dtype", "traced_path", "slot_arguments"]


def fprop_weight(weight: torch.Tensor, recipe: Recipe, *, name: str,
                 context: QuantContext) -> FP4Tensor | None:
    """weight: [N, K] -> the FP4Tensor fprop multiplies now (dither included), None if BF16."""
    # a shallow copy, not dataclasses.replace: that re-runs __init__, whose setting of tick refills
    # a SeedTable (a host-to-device copy of every slot) for the tick it already holds
    quiet = copy.copy(context)
    quiet.collect = False
    call = make_call(recipe, name, quiet)
    if not call.recipe.fprop.b.quantized:
        return None
    return call.operand(call.weight_source(weight), 1, "fprop", "b", codes=True)


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe | int, *,
               name: str = "linear", context: QuantContext | None = None,
               keys: LayerKeys | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K], bias: [N] | None -> [..., N], the three GEMMs per ``recipe``
    (or its nn.ops.register_recipe index: a module's ``recipe_id``). ``keys``: layer_keys(name)
    made once (a module's), so a compiled graph reads no name (below)."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x of shape {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    context = context or QuantContext()
    dtype = compute_dtype(x)
    x, w, b = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    rows = x.shape[:-1].numel()
    with _autocast_off(x.device.type):
        if traced_path(context):
            layers = keys if keys is not None else [layer_key(name)]
            x2d = x.reshape(-1, x.shape[-1])
            y = fp4_gemms_op(x2d, w[None], b, [rows], layers, recipe, context, grouped=False)
            return y.reshape(*x.shape[:-1], weight.shape[0])
        # (the autograd function flattens x and the weight itself: nn.gemms.fp4_gemms)
        return _eager_path(x, w, b, [rows], recipe, [name], context, False)


def expert_names(name: str, n_experts: int, label: str = "") -> list[str]:
    """The layer names of an MoE projection's experts: f"{name}.{e}.{label}" (f"{name}.{e}" unlabelled)."""
    return [f"{name}.{e}.{label}" if label else f"{name}.{e}" for e in range(n_experts)]


def layer_keys(names: list[str]) -> LayerKeys:
    """The layers' integer keys: what a module hands the compiled ops. The opaque ops take them as a
    (CPU, int64) tensor, not Python ints: dynamo guards a tensor's metadata but a constant's value,
    so blocks whose forward it compiles as one frame (an MoE block breaks its graph at routing)
    share one compilation instead of recompiling per layer name. The traced ops (nn.ops.traceable)
    take the ints: their graph draws the layer's seeds by its key, a constant of the graph."""
    return LayerKeys.of([layer_key(n) for n in names])


def grouped_fp4_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor, recipe: Recipe | int, *,
                       name: str, context: QuantContext, label: str = "",
                       keys: LayerKeys | None = None) -> torch.Tensor:
    """x: [S, K] rows sorted by expert (counts[e] each), weight: [E, N, K] -> [S, N]: expert e's
    rows times weight[e]^T under ``recipe``, as fp4_linear(x_e, weight[e], name=f"{name}.{e}.{label}").
    ``keys``: layer_keys of those names, made once (see fp4_linear). ``counts`` as a device tensor
    (where nn.gemms.counts_stay_on_device allows; eager or compiled) are never read on the host,
    so their sum is trusted."""
    on_device = isinstance(counts, torch.Tensor)
    if x.shape[-1] != weight.shape[-1] or len(counts) != weight.shape[0] or (
            not on_device and sum(counts) != x.shape[0]):
        raise ValueError(f"x {tuple(x.shape)} with counts {list(counts)} does not match weight {tuple(weight.shape)}")
    dtype = compute_dtype(x)
    with _autocast_off(x.device.type):
        if traced_path(context):
            layers = keys if keys is not None else [layer_key(n) for n in expert_names(name, weight.shape[0], label)]
            return fp4_gemms_op(x.to(dtype), weight.to(dtype), None, counts, layers, recipe, context, grouped=True)
        names = expert_names(name, weight.shape[0], label)
        return _eager_path(x.to(dtype), weight.to(dtype), None, counts, recipe, names, context, True)


def _autocast_off(device_type: str):
    """Autocast switched off around the GEMMs (their operands are in the compute dtype already);
    nothing to switch where it is off (entering torch.autocast costs several microseconds of host
    time, twice a layer's step)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else (
        contextlib.nullcontext())


def _gemms_with_calls(x, weight, bias, sizes, recipe, names, context, grouped):
    """The autograd Function's path: each layer's Call (its seeds at the context's tick) made here."""
    return fp4_gemms(x, weight, bias, sizes, layer_calls(as_recipe(recipe), names, context), grouped=grouped)


# Compiled, a layer that collects statistics or runs its BF16-forward evaluation takes the eager
# path, and dynamo is kept out of it (a graph break at the call): it reads no context there (a
# guard on the tick would recompile every step), and it does not trace the autograd Function, where
# torch 2.11 under Python 3.12 failed with "SystemError: error return without exception set"
# (tests/nn/test_compile.py, on the device's versions)
_gemms_with_calls_untraced = torch.compiler.disable(_gemms_with_calls)


def _eager_path(*args):
    return (_gemms_with_calls_untraced if torch.compiler.is_compiling() else _gemms_with_calls)(*args)


def slot_arguments(layer: RecipeSlot) -> tuple[str, Recipe | int]:
    """(name, recipe) a layer with a recipe slot (FP4Linear, GroupedExperts) hands fp4_linear or
    grouped_fp4_linear. Traced: no name (the op takes the layer's keys; a read name is a guard) and
    the recipe's index. On the eager path (statistics, a BF16-forward evaluation): its name and the
    recipe itself (an index would be a lookup in the registry, a guard on its length)."""
    return ("", layer.recipe_id) if traced_path(layer.context) else (layer.name, layer.recipe)


def traced_path(context: QuantContext) -> bool:
    """Under torch.compile the GEMMs go through the custom ops of nn.ops (operand statistics, a
    Python side effect, and the BF16-forward evaluation stay eager)."""
    return torch.compiler.is_compiling() and not context.collect and not context.forward_bf16


class FP4Linear(RecipeSlot, nn.Linear):
    """nn.Linear whose three GEMMs follow a recipe; same parameters and state-dict keys."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Recipe,
                 name: str = "linear", context: QuantContext | None = None, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe, self.name, self.keys = recipe, name, layer_keys([name])
        self.context = context or QuantContext()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, *, name: str,
                    context: QuantContext) -> "FP4Linear":
        """Wrap ``linear``'s own parameters (no copy: optimizer state and tying survive)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.recipe, layer.name, layer.context, layer.keys = recipe, name, context, layer_keys([name])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name, recipe = slot_arguments(self)
        return fp4_linear(x, self.weight, self.bias, recipe, name=name, context=self.context, keys=self.keys)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"
