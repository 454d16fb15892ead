"""Where an FP4 run loses precision, per layer: operand statistics and weight "stiction".

    operand_stats(model, fn)   run fn() (a forward + backward) with collection on -> for every
                               quantized operand '<layer>.<gemm>.<a|b>': formats.quant_stats
                               (SQNR, relative error, zero-flushed blocks, saturation, scale range)
    weight_codes(model)        the E2M1 codes each FP4 weight holds in fprop right now, unpacked
    code_flip_rate(old, new)   per weight: the fraction of codes that changed, and the total

Stiction: with RTNE, an update smaller than half a code step leaves the code where it is, so a
weight can keep training in FP32 while its FP4 copy does not move. ``StictionMeter`` measures
the fraction of codes that change per optimizer step (``before()`` / ``after()`` around
``optimizer.step()``); Operand.dither is the intervention that keeps codes moving. Both cost one
weight quantization per layer, so log them every N steps, not every step. A weight sharded by
FSDP2 (a DTensor) is gathered whole first, as its forward gathers it: every rank must call
``weight_codes`` (and the meter) together.

Public: ``operand_stats``, ``weight_codes``, ``code_flip_rate``, ``StictionMeter``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..formats import unpack_nibbles
from .linear import FP4Linear, fprop_weight
from .moe import GroupedExperts
from .swap import quant_context


def operand_stats(model: nn.Module, fn: Callable[[], object]) -> dict[str, dict[str, float]]:
    """Run ``fn`` with operand statistics on; -> '<layer>.<gemm>.<a|b>' -> quant_stats."""
    context = quant_context(model)
    if context is None:
        raise ValueError("model has no recipe: call fp4lab.nn.quantize_model first")
    context.stats.clear()
    context.collect = True
    try:
        fn()
    finally:
        context.collect = False
    return dict(context.stats)


def _whole(w: torch.Tensor) -> torch.Tensor:
    """w, or the full tensor of a DTensor shard (a collective)."""
    if dist.is_initialized():
        from torch.distributed.tensor import DTensor
        if isinstance(w, DTensor):
            return w.full_tensor()
    return w


def _weights(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, FP4Linear):
            yield name, _whole(module.weight), module.recipe, module.context
        elif isinstance(module, GroupedExperts) and module.recipe is not None:
            for label, w in (("gate", module.w_gate), ("up", module.w_up), ("down", module.w_down)):
                w = _whole(w)
                for e in range(w.shape[0]):
                    yield f"{module.name}.{e}.{label}", w[e], module.recipe, module.context


@torch.no_grad()
def weight_codes(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> [rows, Lp] uint8 E2M1 codes of every FP4-quantized fprop weight."""
    codes = {}
    for name, weight, recipe, context in _weights(model):
        q = fprop_weight(weight, recipe, name=name, context=context)
        if q is not None:
            codes[name] = unpack_nibbles(q.codes)
    return codes


def code_flip_rate(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, float]:
    """name -> fraction of codes that differ; 'all' -> over every code of every weight."""
    if old.keys() != new.keys():
        raise ValueError("code snapshots cover different weights")
    rates, flipped, total = {}, 0, 0
    for name in old:
        changed = int((old[name] != new[name]).sum())
        rates[name] = changed / max(old[name].numel(), 1)
        flipped, total = flipped + changed, total + old[name].numel()
    rates["all"] = flipped / max(total, 1)
    return rates


class StictionMeter:
    """Code-flip rate per optimizer step: ``before()``, ``optimizer.step()``, ``after()``."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._old: dict[str, torch.Tensor] | None = None

    def before(self) -> None:
        self._old = weight_codes(self.model)

    def after(self) -> dict[str, float]:
        if self._old is None:
            raise RuntimeError("StictionMeter.after() without before()")
        rates = code_flip_rate(self._old, weight_codes(self.model))
        self._old = None
        return rates
