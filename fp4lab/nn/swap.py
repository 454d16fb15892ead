"""Apply a recipe to a model: swap its linears for FP4Linear, in place, keeping every parameter.

Selection, in order (a module is left alone, in BF16, when any rule keeps it):
    1. its name matches one of ``recipe.keep_bf16`` (fnmatch: "lm_head", "*router*" by default);
    2. it sits in transformer block i (a name segment "blocks.<i>" / "layers.<i>" / "h.<i>") with
       i < first or i >= n_blocks - last, where (first, last) = recipe.bf16_blocks(n_blocks):
       keep_first / keep_last, or keep_fraction resolved against the model's depth.
A recipe that quantizes nothing (``bf16``, with or without gains; a late switch only ever goes
to BF16) swaps nothing: the BF16 arm is the model as users run it, plain nn.Linear layers and
experts on torch._grouped_mm with their counts kept on the device (no per-call recipe machinery,
no host sync at routing), so an FP4 step is timed against the real baseline.
Embeddings and norms are not linears and attention's softmax is not a GEMM, so they stay in
high precision by construction. Modules with a ``use_recipe(recipe, name, context)`` method
(moe.GroupedExperts) are handed the recipe under the same rules. The recipe's gains (any
recipe, BF16 included: they change training, not quantization) go to the model's
``embed_gain`` / ``logits_gain`` attributes.

What the selection resolved to is recorded for receipts (``coverage``, also at
``model.fp4_coverage``)::

    {"blocks": n_blocks, "bf16_first": first, "bf16_last": last,
     "linears": {"fp4": n, "bf16": m}, "fp4_param_fraction": f,
     "flop_fraction": {"fprop": {"bf16": x, "nvfp4": 1 - x}, "dgrad": {...}, "wgrad": {...}}}

A linear is an nn.Linear (FP4Linear included) or a module taking a recipe (one GroupedExperts
holds all of a layer's experts); it counts as fp4 when it runs a recipe that quantizes or
rotates (``Recipe.quantized``: the FP4Linear of a BF16 recipe counts as bf16). f is the
fraction of linear weight elements (expert weights included, biases not) in fp4 linears;
``flop_fraction`` splits each GEMM's linear FLOPs by the format it multiplies in (an expert's
weights weighed by the share of tokens routed to it, top_k / n_experts; attention's score and
value products, always BF16, are not linear FLOPs and not counted). A late switch to BF16
(``bf16_after``) is not reflected: this is the configuration the run starts with.

A recipe that quantizes but selects no linear of the model is an error (a run labelled FP4 that
trains in BF16 would be a silent lie). Parameters are reused, not copied: state-dict keys, tying
and optimizer state are unchanged.

Public: ``quantize_model``, ``quant_context``, ``fp4_modules``, ``coverage``.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from torch import nn

from .linear import FP4Linear, QuantContext
from .moe import MoE
from .recipe import GEMMS, Recipe

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)(?:\.|$)")


def _block_index(name: str) -> int | None:
    match = _BLOCK.search(name)
    return int(match.group(1)) if match else None


def _n_blocks(model: nn.Module) -> int:
    indices = (_block_index(name) for name, _ in model.named_modules())
    return 1 + max((i for i in indices if i is not None), default=-1)


def _kept(name: str, recipe: Recipe, bf16_blocks: tuple[int, int], n_blocks: int) -> bool:
    if any(fnmatch.fnmatchcase(name, p) for p in recipe.keep_bf16):
        return True
    block, (first, last) = _block_index(name), bf16_blocks
    return block is not None and (block < first or block >= n_blocks - last)


def quantize_model(model: nn.Module, recipe: Recipe, *, context: QuantContext | None = None) -> QuantContext:
    """Swap ``model``'s selected nn.Linear modules for FP4Linear under ``recipe`` (in place).
    -> the QuantContext they share (also at ``model.fp4_context``): advance its tick and progress.
    The selection's ``coverage`` is recorded at ``model.fp4_coverage``."""
    if fp4_modules(model):
        raise ValueError("model already has FP4 layers; quantize the original model")
    context = context or QuantContext()
    n_blocks = _n_blocks(model)
    bf16_blocks = recipe.bf16_blocks(n_blocks)
    # a recipe that quantizes nothing swaps nothing: BF16 as users run it (the module doc)
    for name, module in list(model.named_modules()) if recipe.quantized else []:
        if not name or _kept(name, recipe, bf16_blocks, n_blocks):
            continue
        if hasattr(module, "use_recipe"):
            module.use_recipe(recipe, name, context)
        elif type(module) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, FP4Linear.from_linear(module, recipe, name=name, context=context))
    gains = (recipe.embed_gain, recipe.logits_gain)
    if gains != (1.0, 1.0) and not (hasattr(model, "embed_gain") and hasattr(model, "logits_gain")):
        raise ValueError(f"recipe {recipe.name} sets embedding/logit gains {gains} but "
                         f"{type(model).__name__} has no embed_gain / logits_gain")
    if hasattr(model, "embed_gain"):
        model.embed_gain, model.logits_gain = gains
    if any(hasattr(module, "use_recipe") for module in model.modules()):  # grouped experts (QuantContext)
        context.traced_ops = False
    model.fp4_context, model.fp4_recipe = context, recipe
    model.fp4_coverage = coverage(model)
    if recipe.quantized and not model.fp4_coverage["linears"]["fp4"]:
        # a run labelled with an FP4 recipe must not silently train in BF16
        raise ValueError(f"recipe {recipe.name} quantizes no linear of this model: its BF16 blocks (first "
                         f"{bf16_blocks[0]}, last {bf16_blocks[1]} of {n_blocks}) and keep_bf16 {list(recipe.keep_bf16)} "
                         f"cover every one; keep fewer (e.g. keep_first = keep_last = 0) or use a deeper model")
    return context


def quant_context(model: nn.Module) -> QuantContext | None:
    """The QuantContext quantize_model attached to ``model`` (None for a plain model)."""
    return getattr(model, "fp4_context", None)


def fp4_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> every module running a recipe (FP4Linear, or experts given one)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, FP4Linear) or getattr(m, "recipe", None) is not None and hasattr(m, "use_recipe")}


def coverage(model: nn.Module) -> dict[str, Any]:
    """What runs in FP4, as plain data for receipts (the module doc's dict). A plain model has
    every linear in bf16, and bf16_first / bf16_last None (no recipe selected blocks)."""
    n_blocks = _n_blocks(model)
    recipe = getattr(model, "fp4_recipe", None)
    first, last = recipe.bf16_blocks(n_blocks) if recipe is not None else (None, None)
    linears, weights = {"fp4": 0, "bf16": 0}, {"fp4": 0, "bf16": 0}
    flops = {gemm: {} for gemm in GEMMS}
    share = {id(m.experts): m.cfg.top_k / m.cfg.n_experts for m in model.modules() if isinstance(m, MoE)}
    for module in model.modules():
        if isinstance(module, nn.Linear) or hasattr(module, "use_recipe"):
            kind, numel = "fp4" if _runs_fp4(module) else "bf16", _weight_numel(module)
            linears[kind] += 1
            weights[kind] += numel
            # a linear's GEMMs cost 2 x weight elements per token it sees; an expert sees top_k/E of them
            cost = numel * share.get(id(module), 1.0)
            for gemm in GEMMS:
                fmt = _gemm_format(getattr(module, "recipe", None), gemm)
                flops[gemm][fmt] = flops[gemm].get(fmt, 0.0) + cost
    total = weights["fp4"] + weights["bf16"]
    return {"blocks": n_blocks, "bf16_first": first, "bf16_last": last, "linears": linears,
            "fp4_param_fraction": weights["fp4"] / total if total else 0.0,
            "flop_fraction": {gemm: {fmt: f / sum(by.values()) for fmt, f in sorted(by.items())}
                              for gemm, by in flops.items() if by}}


def _gemm_format(recipe, gemm: str) -> str:
    """The format a linear's ``gemm`` multiplies in: its quantized operand's (bf16 when neither is)."""
    spec = recipe.gemm(gemm) if recipe is not None else None
    if spec is None or not spec.quantized:
        return "bf16"
    return str(spec.a.format if spec.a.quantized else spec.b.format)


def _runs_fp4(module: nn.Module) -> bool:
    recipe = getattr(module, "recipe", None)
    return recipe is not None and recipe.quantized


def _weight_numel(module: nn.Module) -> int:
    """Elements of a linear's own weights: nn.Linear's weight, or every parameter of experts."""
    if isinstance(module, nn.Linear):
        return module.weight.numel()
    return sum(p.numel() for p in module.parameters(recurse=False))
