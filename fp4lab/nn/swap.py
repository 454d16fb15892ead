"""Apply a recipe to a model: swap its linears for FP4Linear, in place, keeping every parameter.

Selection, in order (a module is left alone, in BF16, when any rule keeps it):
    1. its name matches one of ``recipe.keep_bf16`` (fnmatch: "lm_head", "*router*" by default);
    2. it sits in transformer block i (a name segment "blocks.<i>" / "layers.<i>" / "h.<i>") with
       i < keep_first or i >= n_blocks - keep_last.
Embeddings and norms are not linears and attention's softmax is not a GEMM, so they stay in
high precision by construction. Modules with a ``use_recipe(recipe, name, context)`` method
(moe.GroupedExperts) are handed the recipe under the same rules. The NVFP4-only gains go to the
model's ``embed_gain`` / ``logits_gain`` attributes.

Parameters are reused, not copied: state-dict keys, tying and optimizer state are unchanged.

Public: ``quantize_model``, ``quant_context``, ``fp4_modules``.
"""

from __future__ import annotations

import fnmatch
import re

from torch import nn

from .linear import FP4Linear, QuantContext
from .recipe import Recipe

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)(?:\.|$)")


def _block_index(name: str) -> int | None:
    match = _BLOCK.search(name)
    return int(match.group(1)) if match else None


def _kept(name: str, recipe: Recipe, n_blocks: int) -> bool:
    if any(fnmatch.fnmatchcase(name, p) for p in recipe.keep_bf16):
        return True
    block = _block_index(name)
    return block is not None and (block < recipe.keep_first or block >= n_blocks - recipe.keep_last)


def quantize_model(model: nn.Module, recipe: Recipe, *, context: QuantContext | None = None) -> QuantContext:
    """Swap ``model``'s selected nn.Linear modules for FP4Linear under ``recipe`` (in place).
    -> the QuantContext they share (also at ``model.fp4_context``): advance its tick and progress."""
    if fp4_modules(model):
        raise ValueError("model already has FP4 layers; quantize the original model")
    context = context or QuantContext()
    names = [name for name, _ in model.named_modules()]
    n_blocks = 1 + max((i for i in map(_block_index, names) if i is not None), default=-1)
    for name, module in list(model.named_modules()):
        if not name or _kept(name, recipe, n_blocks):
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
    model.fp4_context, model.fp4_recipe = context, recipe
    return context


def quant_context(model: nn.Module) -> QuantContext | None:
    """The QuantContext quantize_model attached to ``model`` (None for a plain model)."""
    return getattr(model, "fp4_context", None)


def fp4_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> every module running a recipe (FP4Linear, or experts given one)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, FP4Linear) or getattr(m, "recipe", None) is not None and hasattr(m, "use_recipe")}
