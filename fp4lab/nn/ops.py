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
``keep_w`` (an input gradient follows), a layer whose dgrad multiplies fprop's weight tiles
transposed (gemms.keeps_w_values, from the recipe and the arguments alone) returns those block
values (dense: [N, K, each padded to 16], and its tensor scale; grouped, where every expert has
rows: every expert's tiles of fprop's one launch, [G N, K padded], and the [G] tensor scales), so
the backward does not quantize the weight again, as eager does not.

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

Differences from the eager path, costs rather than results: a layer whose fprop weight tiles the
op does not keep (gemms.keeps_w_values: for an MoE projection an expert without rows under host
sizes, N not whole 16-row tiles, a dithered weight, or a recipe with a late switch, ``bf16_after``)
quantizes dgrad's weights again in backward, where eager keeps fprop's (the same values, tested in
nn.gemms), and a dithered weight is dithered again there (the same seed). Operand
statistics (a Python side effect) are not collected here: layers with ``context.collect`` take
the eager path.

A module hands the op its recipe's index as an int attribute of its own (``RecipeSlot``), set
when the recipe is assigned: a compiled graph then guards that int, where a lookup of the recipe
object in the registry would guard the registry's length, and every frame would recompile
whenever another run in the process registered a recipe (the eighth hits dynamo's recompile
limit, and the frame falls back to eager).

**Traced ops.** An opaque op's body is the eager path's Python, run at every call of the compiled
model: a compiled FP4 step spent more host time than the eager one. Where a graph can hold a dense
layer's call (``traceable``: the Triton kernels run, every seed the recipe draws is a SeedTable
slot, no ``bf16_after``, every GEMM fp4lab's kernels alone; and the context's ``traced_ops``), the
layer takes two ``torch.library.triton_op`` instead:

    fp4lab::gemms_traced           (x, weight, bias, layer, recipe, rank, seed_values, seeds, keep_x, keep_w)
                                   -> as fp4lab::gemms
    fp4lab::gemms_traced_backward  (dy, x, weight, layer, recipe, rank, seed_values, seeds, need_dx, need_dw,
                                    x_wgrad, x_wgrad_scale, w_values, w_scale) -> (dx, dw)

Their body is the same (``_forward``, ``_backward_body``), but AOTAutograd traces it: the plans,
checks and Calls run once, while compiling, and each kernel launch is recorded (kernels.launch:
``wrap_triton``) for Inductor to make from its generated code. ``layer`` is the layer's key as an
int (a constant of the graph: the layer's seeds are looked up by it while tracing; 0 for a recipe
that draws none), and ``seed_values`` the table's buffer, whose slots the graph reads
(nn.seeds.SeedSlots): the compiled step reads each tick's seeds. kernels.matmul's persistent GEMM
makes its TMA descriptors on the device there (a host descriptor cannot be recorded).
FP4LAB_TRACED=0 keeps every layer on the opaque ops. AOTAutograd's compile cache cannot see into
a traced op's body, so a process that compiles one turns that cache off (``_without_autograd_cache``;
Inductor's own cache still keys on the recorded kernels). A key read as an int is a guard on its value:
a model compiled in several frames (a graph break in each block) would compile a seed-drawing
traced layer's frame once per layer, and past dynamo's recompile limit run the later blocks
eagerly, so a model with grouped experts (routing may break its graph) keeps the opaque ops
(QuantContext.traced_ops).

Public: ``register_recipe``, ``recipe_index``, ``registered_recipe``, ``as_recipe``, ``RecipeSlot``,
``LayerKeys``, ``traceable``, ``fp4_gemms_op``.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

from ..kernels import BlockValues, GroupedValues
from .. import kernels
from ..kernels.host import env
from .gemms import (WGRAD_ROW_MULTIPLE, Call, QuantContext, call_at, capturing, draws_seeds, gemms_backward,
                    gemms_forward, keeps_w_values, keeps_x_wgrad, kernels_only, w_values_shape, x_wgrad_operand)
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
        # keys pickled as a tensor (before LayerKeys), or a dict of them per label: both forms now
        keys = self.__dict__.get("keys")
        if isinstance(keys, torch.Tensor):
            self.keys = LayerKeys.of(keys.tolist())
        elif isinstance(keys, dict):
            self.keys = {k: LayerKeys.of(v.tolist()) if isinstance(v, torch.Tensor) else v for k, v in keys.items()}


class LayerKeys(NamedTuple):
    """A module's layers' integer keys (gemms.layer_key), made once, in the two forms the ops take:
    a CPU int64 tensor for the opaque ops (dynamo guards its metadata, not its values) and the ints
    for the traced ops (constants of the graph)."""

    tensor: torch.Tensor
    ints: tuple[int, ...]

    @classmethod
    def of(cls, keys: list[int]) -> "LayerKeys":
        return cls(torch.tensor(keys, dtype=torch.int64), tuple(keys))


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
    calls = _calls(layers, recipe, clock, rank, seeds)
    return _forward(x, weight, bias, _sizes_or_counts(sizes, counts), calls, grouped, keep_x, keep_w,
                    registered_recipe(recipe))


def _forward(x, weight, bias, sizes, calls, grouped, keep_x, keep_w, r):
    """Both forward ops' body under the registered recipe ``r``: gemms_forward, and what it keeps
    for the backward as tensors."""
    keep = keeps_x_wgrad(r, x, grouped, keep_x)
    keep_w = keeps_w_values(r, grouped, keep_w, every_group_live=_every_group_live(sizes), n=weight.shape[-2])
    y, saved = gemms_forward(x, weight, bias, sizes, calls, grouped, keep=keep_w, keep_x=keep)
    w_out = _weights_kept(saved["w_values"], grouped) if keep_w else _none_kept(x)
    if not keep:
        return y, *_none_kept(x), *w_out
    # made in fprop's read, or (the pair switched off since the graph was planned) on its own
    return y, *_values_and_scale(saved.get("x_wgrad") or x_wgrad_operand(x, calls[0])), *w_out


def _every_group_live(sizes: list[int] | torch.Tensor) -> bool:
    """Every group has rows: device counts (all groups run), or host sizes none of them 0."""
    return isinstance(sizes, torch.Tensor) or all(sizes)


def _weights_kept(w_values: list[BlockValues] | GroupedValues, grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fprop's weight tiles as the forward op returns them: a dense layer's operand, or every
    expert's tiles of one launch with their [G] tensor scales (keeps_w_values promised that one)."""
    if not grouped:
        return _values_and_scale(w_values[0])
    if not isinstance(w_values, GroupedValues):
        raise RuntimeError("a grouped layer's forward promised every expert's weight tiles from one launch, "
                           f"and fprop made {type(w_values).__name__}: keeps_w_values and gemms_forward disagree")
    scales = w_values.tensor_scales
    return w_values.values, (scales if scales is not None else w_values.values.new_empty(0, dtype=torch.float32))


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
    w_out = _none_kept(x)
    live = _every_group_live(_sizes_or_counts(sizes, counts))
    if keeps_w_values(r, grouped, keep_w, every_group_live=live, n=weight.shape[-2]):
        w_scale = scale(r.fprop.b)
        if grouped and w_scale.dim() == 0:  # (one per expert)
            w_scale = x.new_empty(weight.shape[0], dtype=torch.float32)
        w_out = x.new_empty(w_values_shape(weight), dtype=torch.bfloat16), w_scale
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
    calls = _calls(layers, recipe, clock, rank, seeds)
    return _backward_body(dy, x, weight, _sizes_or_counts(sizes, counts), calls, grouped, need_dx, need_dw,
                          x_wgrad, x_wgrad_scale, w_values, w_scale, registered_recipe(recipe))


def _backward_body(dy, x, weight, sizes, calls, grouped, need_dx, need_dw, x_wgrad, x_wgrad_scale, w_values,
                   w_scale, r):
    """Both backward ops' body under the registered recipe ``r``: gemms_backward on what the
    forward op kept."""
    # what the forward op kept: wgrad's copy of x, fprop's weight tiles (None: not kept)
    xw = _kept(x_wgrad, x_wgrad_scale, x.shape[1], r.wgrad.b.format)
    if grouped:  # every expert's tiles (or none kept)
        g, n = weight.shape[:2]
        wv = None if not w_values.numel() else GroupedValues(w_values, w_scale if w_scale.numel() else None,
                                                              (n,) * g, r.fprop.b.format)
    else:
        wv = _kept(w_values, w_scale, weight.shape[1], r.fprop.b.format)
        wv = None if wv is None else [wv]
    saved = {"x_wgrad": xw, "w_values": wv}
    dx, dw = gemms_backward(dy, x, weight, sizes, calls, grouped, need_dx=need_dx, need_dw=need_dw, saved=saved)
    # an op returns tensors, never None: an empty one stands for a gradient not asked for
    return (dx if dx is not None else x.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@_gemms_backward.register_fake
def _(dy, x, weight, sizes, counts, layers, recipe, clock, rank, seeds, grouped, need_dx, need_dw, x_wgrad,
      x_wgrad_scale, w_values, w_scale):
    return (torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else x.new_empty(0)), (
        torch.empty_like(weight) if need_dw else weight.new_empty(0))


def _save(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, output: tuple, *extra) -> None:
    """What both forward ops save for their backward: x, the weight, ``extra`` tensors, then what
    the op kept (its outputs past y). With wgrad's copy of x kept, backward needs x's shape alone:
    a one-element stand-in is saved."""
    kept = output[1:]
    keeps_x = kept[0].numel() > 0
    ctx.mark_non_differentiable(*kept)  # (no zero gradients made for them)
    ctx.save_for_backward(x.new_zeros(1) if keeps_x else x, weight, *extra, *kept)
    ctx.x_shape = tuple(x.shape) if keeps_x else None
    ctx.has_bias = bias is not None


def _saved(ctx) -> tuple:
    """(x, weight, *extra, *kept) as _save saved them, x at its shape again."""
    x, *rest = ctx.saved_tensors
    return (x if ctx.x_shape is None else x.expand(ctx.x_shape)), *rest


def _gradients(ctx, dy: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor, inputs: int) -> tuple:
    """A backward op's (dx, dw) as autograd takes them, with the bias's and Nones for the op's
    other ``inputs``."""
    db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), db, *[None] * (
        inputs - 3)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, sizes, counts, layers, recipe, clock, rank, seeds, grouped, keep_x, keep_w = inputs
    # the trainer may move the clock before backward; counts (None: sizes) ride along as a tensor
    _save(ctx, x, weight, bias, output, clock.clone(), layers, counts)
    ctx.args = (sizes, recipe, rank, seeds, grouped)


def _backward(ctx, dy: torch.Tensor, *unused):
    x, weight, clock, layers, counts, *kept = _saved(ctx)
    sizes, recipe, rank, seeds, grouped = ctx.args
    dx, dw = torch.ops.fp4lab.gemms_backward(dy, x, weight, sizes, counts, layers, recipe, clock, rank, seeds,
                                             grouped, *ctx.needs_input_grad[:2], *kept)
    return _gradients(ctx, dy, dx, dw, 13)


_gemms.register_autograd(_backward, setup_context=_setup_context)


def _traced_op(name: str):
    """torch.library.triton_op where triton is installed; without it a plain custom op of the same
    body (``traceable`` never picks it there, and torch's triton_op warns at its definition that
    it can look for no kernels)."""
    if importlib.util.find_spec("triton") is None:
        return torch.library.custom_op(name, mutates_args=())
    return torch.library.triton_op(name, mutates_args=())


@_traced_op("fp4lab::gemms_traced")
def _gemms_traced(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int, recipe: int,
                  rank: int, seed_values: torch.Tensor | None, seeds: int, keep_x: bool, keep_w: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    calls = _traced_calls(layer, recipe, rank, seed_values, seeds)
    return _forward(x, weight, bias, [x.shape[0]], calls, False, keep_x, keep_w, registered_recipe(recipe))


@_traced_op("fp4lab::gemms_traced_backward")
def _gemms_traced_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, layer: int, recipe: int,
                           rank: int, seed_values: torch.Tensor | None, seeds: int, need_dx: bool, need_dw: bool,
                           x_wgrad: torch.Tensor, x_wgrad_scale: torch.Tensor, w_values: torch.Tensor,
                           w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    calls = _traced_calls(layer, recipe, rank, seed_values, seeds)
    return _backward_body(dy, x, weight, [x.shape[0]], calls, False, need_dx, need_dw, x_wgrad, x_wgrad_scale,
                          w_values, w_scale, registered_recipe(recipe))


def _traced_calls(layer: int, recipe: int, rank: int, seed_values: torch.Tensor | None, seeds: int) -> list[Call]:
    """The traced ops' Call: no tick (traceable's rule: every seed it draws is a slot of the table,
    read from ``seed_values``, the table's buffer as the op was handed it, and no progress decides
    the recipe)."""
    table = table_at(seeds)
    return [call_at(registered_recipe(recipe), layer, 0, 0.0, rank, seeds=None if table is None
                    else table.reading(seed_values))]


def _setup_traced(ctx, inputs, output) -> None:
    x, weight, bias, layer, recipe, rank, seed_values, seeds, keep_x, keep_w = inputs
    _save(ctx, x, weight, bias, output, seed_values)
    ctx.args = (layer, recipe, rank)
    ctx.seeds = seeds


def _backward_traced(ctx, dy: torch.Tensor, *unused):
    x, weight, seed_values, *kept = _saved(ctx)
    dx, dw = torch.ops.fp4lab.gemms_traced_backward(dy, x, weight, *ctx.args, seed_values, ctx.seeds,
                                                    *ctx.needs_input_grad[:2], *kept)
    return _gradients(ctx, dy, dx, dw, 10)


_gemms_traced.register_autograd(_backward_traced, setup_context=_setup_traced)


@torch.compiler.assume_constant_result  # (a constant of the graph: dynamo reads no registry to decide it)
def traceable(recipe: int, table: bool, device: str) -> bool:
    """Whether a dense layer's GEMMs under the registered ``recipe`` go through the traced ops,
    whose launches Inductor makes itself: the Triton kernels run them (CUDA, not the interpreter);
    every seed the recipe draws comes from a SeedTable (``table``; a traced graph would freeze an
    int seed); no ``bf16_after`` switches it with the progress (a traced graph holds the recipe);
    and its GEMMs are fp4lab's kernels alone (gemms.kernels_only: no torch arithmetic in the body
    for Inductor to round its own way). FP4LAB_TRACED=0 keeps every layer on the opaque ops. Made
    for Inductor, torch.compile's default backend: another backend runs the recorded launches
    through Triton's launcher, which has no allocator for the persistent GEMM's device-made TMA
    descriptors (kernels.matmul); set FP4LAB_TRACED=0 there."""
    r = registered_recipe(recipe)
    return (device == "cuda" and kernels.uses_triton(torch.device(device)) and env("TRITON_INTERPRET") != "1"
            and env("FP4LAB_TRACED", "1").lower() not in ("0", "false", "off", "no")
            and r.bf16_after is None and kernels_only(r) and (table or not draws_seeds(r)))


@torch.compiler.assume_constant_result  # (so dynamo runs it for real while it traces the call)
def _without_autograd_cache() -> bool:
    """Turns AOTAutograd's compile cache off in this process; called where dynamo traces a traced
    op's call, before the frame is handed to AOTAutograd. That cache keys a graph by dynamo's nodes
    and constants and cannot see into a traced op's body, so a hit skips the body: its kernels
    would come from whatever code compiled the cached graph (on the H100 another commit's kernels,
    and another FP4LAB_CUBLASLT's GEMMs, came back in seconds: benchmarks/NOTES.md, twenty-fourth
    session), its recipe index would name another process's recipe, and no SeedTable slot would be
    drawn, so the graph would read seeds nobody writes. Without it the body is traced in every
    process and Inductor's own cache keys on the kernels it records (their source included).
    TORCHINDUCTOR_AUTOGRAD_CACHE=1 in the environment overrides this: don't, with FP4 layers."""
    import torch._functorch.config as functorch_config
    functorch_config.enable_autograd_cache = False
    return True


@torch.compiler.assume_constant_result
def _keyed(recipe: int) -> bool:
    """Whether a traced layer under the registered ``recipe`` needs its key: only to find the
    seeds it draws (a recipe drawing none passes 0, and a graph per layer key is not made)."""
    return draws_seeds(registered_recipe(recipe))


def fp4_gemms_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | torch.Tensor,
                 layers: LayerKeys | list[int], recipe: Recipe | int, context: QuantContext, *,
                 grouped: bool) -> torch.Tensor:
    """gemms.fp4_gemms through the custom ops (the traced ones where ``traceable`` says, with static
    shapes): the layers given by key (a module's LayerKeys, or ints), at the context's clock;
    ``sizes`` as host ints or, for a grouped call, a device tensor of counts (passed on as
    ``counts``); ``recipe`` or its registered index (a module's ``recipe_id``: no scan of the
    registry, see RecipeSlot)."""
    seeds = -1 if context.seeds is None else context.seeds.index
    index = recipe if isinstance(recipe, int) else recipe_index(recipe)
    # what backward will ask for (the eager path's rule): dW (keep wgrad's x), dx (keep fprop's weight tiles)
    keep_x = torch.is_grad_enabled() and weight.requires_grad
    keep_w = torch.is_grad_enabled() and x.requires_grad
    # (the ints are read only on the traced path: a read is a guard on their values, and a frame
    # compiled per block; keys made before LayerKeys, a tensor, take the opaque ops)
    if (not grouped and not isinstance(layers, torch.Tensor) and context.traced_ops
            and all(type(n) is int for n in (*x.shape, *weight.shape))  # (static shapes: plans)
            and traceable(index, seeds >= 0, x.device.type)):
        values = None if context.seeds is None else context.seeds.values
        layer = (layers.ints if isinstance(layers, LayerKeys) else list(layers))[0] if _keyed(index) else 0
        if torch.compiler.is_compiling():
            _without_autograd_cache()
        return _gemms_traced(x, weight, bias, layer, index, context.rank, values, seeds, keep_x, keep_w)[0]
    keys = (layers.tensor if isinstance(layers, LayerKeys) else layers if isinstance(layers, torch.Tensor)
            else torch.tensor(list(layers), dtype=torch.int64))
    counts, sizes = (sizes, []) if isinstance(sizes, torch.Tensor) else (None, list(sizes))
    return _gemms(x, weight, bias, sizes, counts, keys, index, context.clock, context.rank, seeds, grouped,
                  keep_x, keep_w)[0]
