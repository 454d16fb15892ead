"""The three GEMMs of nn.gemms as PyTorch custom ops: what torch.compile traces.

The autograd function of nn.gemms holds Python objects (the layer's Calls, operand block
values) that dynamo cannot put in a graph, so a compiled FP4 model used to break its graph at
every FP4 layer. Here the same two halves, ``gemms_forward`` and ``gemms_backward``, run inside
two opaque ops whose arguments are all graph-friendly:

    fp4lab::gemms           (x, weight, bias, sizes, counts, layers, recipe, clock, rank, seeds, grouped,
                             keep_x, keep_w) -> (y, x_wgrad, x_wgrad_scale, w_values, w_scale)
    fp4lab::gemms_backward  (dy, x, weight, ...same..., need_dx, need_dw, x_wgrad, x_wgrad_scale, w_values,
                             w_scale) -> (dx, dw)

With ``keep_x`` (a weight gradient follows), a dense layer whose two copies of x pair
(gemms.keeps_x_wgrad, decided from the recipe before the op runs: an op's outputs cannot depend
on what it finds) returns wgrad's copy of x, made in the read that made fprop's, as eager does:
its block values [K, rows padded to 32] and tensor scale (empty tensors where none), saved for
the backward in place of x (which then travels as a one-element stand-in of its shape). With
``keep_w`` (an input gradient follows), a dense layer whose dgrad multiplies fprop's weight tiles
transposed (gemms.keeps_w_values, from the recipe alone) returns those block values [N, K, each
padded to 16] and their tensor scale, so the backward does not quantize the weight again, as
eager does not.

``counts``, where given, are a grouped call's row counts as a device tensor (``sizes`` is then
empty): the routing's counts never read on the host, so a compiled MoE block is one graph and a
CUDA graph can capture it (nn.gemms.counts_stay_on_device says which recipes allow it).

``layers`` are the layers' integer keys (gemms.layer_key) in a CPU int64 tensor (a module's
``keys``, made once: dynamo guards a tensor's metadata, where a Python constant would be a guard on
its value, one compilation per layer name wherever a graph break splits the model into frames),
``recipe`` a recipe's index in a registry of this process, ``seeds`` the index of the context's
nn.seeds.SeedTable (-1: none; with one, the kernels read every seed from its device buffer, so a
CUDA graph around the compiled step draws each step's bits), ``clock`` the QuantContext's
[tick, progress] tensor: the step changes a tensor's value, not a Python number dynamo would
guard on, so the compiled graph serves every step without recompiling. Each op rebuilds the Calls
from them (gemms.call_at), so its results are bit-identical to the eager path's (tested).

Differences from the eager path, costs rather than results: an MoE projection's dgrad makes
fprop's tiles of every expert again in one launch and transposes them, where eager keeps them
(the same values, tested in nn.gemms; each expert's weight quantized alone cost two launches an
expert), and where dgrad does not multiply fprop's tiles, a dithered weight is dithered again in
backward (the same seed). Operand
statistics (a Python side effect) are not collected here: layers with ``context.collect`` take
the eager path.

A module hands the op its recipe's index as an int attribute of its own (``RecipeSlot``), set
when the recipe is assigned: a compiled graph then guards that int, where a lookup of the recipe
object in the registry would guard the registry's length, and every frame would recompile
whenever another run in the process registered a recipe (the eighth hits dynamo's recompile
limit, and the frame falls back to eager).

Public: ``register_recipe``, ``recipe_index``, ``registered_recipe``, ``as_recipe``, ``RecipeSlot``,
``fp4_gemms_op``.
"""

from __future__ import annotations

import torch

from ..kernels import BlockValues
from .gemms import (WGRAD_ROW_MULTIPLE, QuantContext, call_at, capturing, gemms_backward, gemms_forward,
                    keeps_w_values, keeps_x_wgrad, w_values_shape, x_wgrad_operand)
from .recipe import Recipe
from .seeds import table_at

_RECIPES: list[Recipe] = []  # index -> recipe (equal recipes share one index)
_SEEN: list[tuple[Recipe, int]] = []  # every recipe object registered, with its index


def register_recipe(recipe: Recipe) -> int:
    """-> the index of ``recipe`` in this process's registry (added on first sight). Modules
    register their recipe when they get it (RecipeSlot), outside any trace."""
    for known, i in _SEEN:
        if known is recipe:
            return i
    for i, known in enumerate(_RECIPES):
        if known == recipe:
            break
    else:
        _RECIPES.append(recipe)
        i = len(_RECIPES) - 1
    _SEEN.append((recipe, i))
    return i


# a recipe first seen inside a trace (fp4_linear called directly on a new recipe): newer dynamo
# folds the call to a constant; torch 2.11 cannot pass it a frozen dataclass
_register_traced = torch.compiler.assume_constant_result(register_recipe)


def recipe_index(recipe: Recipe) -> int:
    """register_recipe as a compiled graph can call it: an identity scan dynamo traces (and guards
    on the registry's length: modules pass their RecipeSlot index instead)."""
    for known, i in _SEEN:
        if known is recipe:
            return i
    return _register_traced(recipe)


def registered_recipe(index: int) -> Recipe:
    """The recipe register_recipe gave ``index``."""
    return _RECIPES[index]


def as_recipe(recipe: Recipe | int) -> Recipe:
    """A recipe, or the index register_recipe gave one, as the recipe."""
    return registered_recipe(recipe) if isinstance(recipe, int) else recipe


class RecipeSlot:
    """Mixin for modules whose GEMMs follow a recipe: assigning ``recipe`` (None: none) registers
    it, outside any trace, and keeps its index as ``recipe_id``, the int the module hands the
    compiled op (a guard on the module's own attribute: equal recipes share an index, so a second
    run in the process finds its graphs compiled)."""

    @property
    def recipe(self) -> Recipe | None:
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Recipe | None) -> None:
        self._recipe = recipe
        self.recipe_id = None if recipe is None else register_recipe(recipe)

    def __setstate__(self, state: dict) -> None:
        # unpickled in another process, whose registry numbers recipes its own way (a module
        # pickled before the slot existed kept its recipe under "recipe")
        super().__setstate__(state)
        if "_recipe" in state or "recipe" in state:
            self.recipe = state["_recipe"] if "_recipe" in state else self.__dict__.pop("recipe")


def _calls(layers: torch.Tensor, recipe: int, clock: torch.Tensor, rank: int, seeds: int):
    table = table_at(seeds)
    if table is None and capturing():  # int seeds: a CUDA graph would freeze the first step's
        raise RuntimeError("the compiled FP4 ops draw int seeds here, which a CUDA graph would freeze: give the "
                           "QuantContext a nn.seeds.SeedTable before compiling (train.graphed does)")
    tick, progress = clock.tolist()
    return [call_at(registered_recipe(recipe), layer, int(tick), progress, rank, seeds=table) for layer in layers.tolist()]


@torch.library.custom_op("fp4lab::gemms", mutates_args=())
def _gemms(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int],
           counts: torch.Tensor | None, layers: torch.Tensor, recipe: int, clock: torch.Tensor, rank: int, seeds: int,
           grouped: bool, keep_x: bool, keep_w: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r = registered_recipe(recipe)
    keep, keep_w = keeps_x_wgrad(r, x, grouped, keep_x), keeps_w_values(r, grouped, keep_w)
    calls = _calls(layers, recipe, clock, rank, seeds)
    y, saved = gemms_forward(x, weight, bias, _sizes_or_counts(sizes, counts), calls, grouped, keep=keep_w,
                             keep_x=keep)
    w_out = _values_and_scale(saved["w_values"][0]) if keep_w else _none_kept(x)
    if not keep:
        return y, *_none_kept(x), *w_out
    # made in fprop's read, or (the pair switched off since the graph was planned) on its own
    return y, *_values_and_scale(saved.get("x_wgrad") or x_wgrad_operand(x, calls[0])), *w_out


def _values_and_scale(v: BlockValues) -> tuple[torch.Tensor, torch.Tensor]:
    """An operand as the op returns it: its block values and its tensor scale (empty: none)."""
    return v.values, (v.tensor_scale if v.tensor_scale is not None else v.values.new_empty(0, dtype=torch.float32))


def _none_kept(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (values, scale) pair of an operand not kept: two empty tensors."""
    return x.new_empty(0, dtype=torch.bfloat16), x.new_empty(0, dtype=torch.float32)


def _kept(values: torch.Tensor, scale: torch.Tensor, rows: int, fmt) -> BlockValues | None:
    """The operand the forward op returned as (values, scale), or None where it kept none."""
    if not values.numel():
        return None
    return BlockValues(values, scale if scale.numel() else None, rows, fmt)


def _sizes_or_counts(sizes: list[int], counts: torch.Tensor | None) -> list[int] | torch.Tensor:
    return sizes if counts is None else counts


@_gemms.register_fake
def _(x, weight, bias, sizes, counts, layers, recipe, clock, rank, seeds, grouped, keep_x, keep_w):
    y = x.new_empty(x.shape[0], weight.shape[1])
    r = registered_recipe(recipe)

    def scale(spec) -> torch.Tensor:
        return x.new_empty((), dtype=torch.float32) if spec.format.spec.tensor_scale else x.new_empty(
            0, dtype=torch.float32)
    w_out = ((x.new_empty(w_values_shape(weight), dtype=torch.bfloat16), scale(r.fprop.b))
             if keeps_w_values(r, grouped, keep_w) else _none_kept(x))
    if not keeps_x_wgrad(r, x, grouped, keep_x):
        return y, *_none_kept(x), *w_out
    rows = x.shape[0] + (-x.shape[0] % WGRAD_ROW_MULTIPLE)
    return y, x.new_empty(x.shape[1], rows, dtype=torch.bfloat16), scale(r.wgrad.b), *w_out


@torch.library.custom_op("fp4lab::gemms_backward", mutates_args=())
def _gemms_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, sizes: list[int],
                    counts: torch.Tensor | None, layers: torch.Tensor, recipe: int, clock: torch.Tensor, rank: int,
                    seeds: int, grouped: bool, need_dx: bool, need_dw: bool, x_wgrad: torch.Tensor,
                    x_wgrad_scale: torch.Tensor, w_values: torch.Tensor, w_scale: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    # what the forward op kept: wgrad's copy of x, fprop's weight tiles (None: not kept)
    r = registered_recipe(recipe)
    xw = _kept(x_wgrad, x_wgrad_scale, x.shape[1], r.wgrad.b.format)
    wv = _kept(w_values, w_scale, weight.shape[1], r.fprop.b.format)
    saved = {"x_wgrad": xw, "w_values": None if wv is None else [wv]}
    dx, dw = gemms_backward(dy, x, weight, _sizes_or_counts(sizes, counts), _calls(layers, recipe, clock, rank, seeds),
                            grouped, need_dx=need_dx, need_dw=need_dw, saved=saved)
    # an op returns tensors, never None: an empty one stands for a gradient not asked for
    return (dx if dx is not None else x.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@_gemms_backward.register_fake
def _(dy, x, weight, sizes, counts, layers, recipe, clock, rank, seeds, grouped, need_dx, need_dw, x_wgrad,
      x_wgrad_scale, w_values, w_scale):
    return (torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else x.new_empty(0)), (
        torch.empty_like(weight) if need_dw else weight.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, sizes, counts, layers, recipe, clock, rank, seeds, grouped, keep_x, keep_w = inputs
    _, x_wgrad, x_wgrad_scale, w_values, w_scale = output
    # with wgrad's copy of x kept, backward needs x's shape alone: a one-element stand-in is saved
    kept = x_wgrad.numel() > 0
    x_saved = x.new_zeros(1) if kept else x
    ctx.mark_non_differentiable(x_wgrad, x_wgrad_scale, w_values, w_scale)  # (no zero gradients made for them)
    # the trainer may move the clock before backward; counts (None: sizes) ride along as a tensor
    ctx.save_for_backward(x_saved, weight, clock.clone(), layers, counts, x_wgrad, x_wgrad_scale, w_values, w_scale)
    ctx.x_shape = tuple(x.shape) if kept else None
    ctx.args = (sizes, recipe, rank, seeds, grouped)
    ctx.has_bias = bias is not None


def _backward(ctx, dy: torch.Tensor, *unused):
    x, weight, clock, layers, counts, *kept = ctx.saved_tensors
    if ctx.x_shape is not None:
        x = x.expand(ctx.x_shape)
    sizes, recipe, rank, seeds, grouped = ctx.args
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = torch.ops.fp4lab.gemms_backward(dy, x, weight, sizes, counts, layers, recipe, clock, rank, seeds,
                                             grouped, need_dx, need_dw, *kept)
    db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return (dx if need_dx else None), (dw if need_dw else None), db, *[None] * 10


_gemms.register_autograd(_backward, setup_context=_setup_context)


def fp4_gemms_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | torch.Tensor,
                 layers: torch.Tensor | list[int], recipe: Recipe | int, context: QuantContext, *,
                 grouped: bool) -> torch.Tensor:
    """gemms.fp4_gemms through the custom ops: the layers given by key (a CPU int64 tensor, or
    ints folded into one), at the context's clock; ``sizes`` as host ints or, for a grouped call,
    a device tensor of counts (passed on as ``counts``); ``recipe`` or its registered index (a
    module's ``recipe_id``: no scan of the registry, see RecipeSlot)."""
    if not isinstance(layers, torch.Tensor):
        layers = torch.tensor(list(layers), dtype=torch.int64)
    seeds = -1 if context.seeds is None else context.seeds.index
    counts, sizes = (sizes, []) if isinstance(sizes, torch.Tensor) else (None, list(sizes))
    index = recipe if isinstance(recipe, int) else recipe_index(recipe)
    # what backward will ask for (the eager path's rule): dW (keep wgrad's x), dx (keep fprop's weight tiles)
    keep_x = torch.is_grad_enabled() and weight.requires_grad
    keep_w = torch.is_grad_enabled() and x.requires_grad
    return _gemms(x, weight, bias, sizes, counts, layers, index, context.clock, context.rank, seeds, grouped,
                  keep_x, keep_w)[0]
