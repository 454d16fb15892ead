"""Mixture-of-Experts feed-forward: top-K routed SwiGLU experts plus always-on shared experts.

Shape legend: T tokens, D model dim, F expert hidden dim, E routed experts, K experts per token.

    scores_TE  = sigmoid(router(x)) or softmax(router(x))          router stays BF16 by default
    choice_TK  = topk(scores_TE + bias_E, K)      the bias steers selection only (DeepSeek-V3's
                                                  auxiliary-loss-free balancing)
    weight_TK  = scores at choice, normalised to sum 1 per token
    y_TD       = shared(x) + sum_k weight_TK * expert[choice_TK](x)

Expert GEMMs are grouped: tokens sorted by expert (a stable sort), one GEMM per expert on its
variable number of rows. Without a recipe they run as ``torch._grouped_mm`` (all experts in one
call, offsets from the counts on the device, no host sync) in bf16 (autocast) on the CPU and on
CUDA from sm90, else as a loop over experts. Under a recipe, each projection is
nn.linear.grouped_fp4_linear: every expert's three GEMMs as the recipe says, with a tensor scale
per expert operand, fprop and dgrad of all experts in one launch on the Triton backend. Where the
recipe allows before and after any late switch (``steps_keep_counts``, by
nn.gemms.counts_stay_on_device) and the step's seeds live on the device (a SeedTable: the
trainer's on CUDA, train.run.seeds_on_device, and a graphed step's), they take the routing's
counts as the device tensor they are, eager or compiled: no wait for the GPU at each MoE layer,
and a CUDA graph can capture the step. Steps that collect operand stats, BF16-forward
evaluations and FP4LAB_DEVICE_COUNTS=0 read them on the host instead (the same bits). The
combine un-sorts and sums the K contributions in a fixed order, so the forward is deterministic
on GPU too (no atomics).

Balancing: each training forward adds the tokens each expert received to ``load_E``;
``update_bias()`` (after the optimizer step) moves ``bias_E += rate * sign(mean(load) - load)``
and clears the count. An optional Switch-style auxiliary loss, ``aux_coef * E * sum_e f_e P_e``
(f: fraction of routed slots, P: mean normalised score), is left in ``aux_loss`` for the model.
``routing_stats()`` reports the load fractions of the last counts and their imbalance.

Public: ``MoEConfig``, ``RouterKind``, ``GroupedExperts``, ``MoE``, ``grouped_mm_runs``, ``steps_keep_counts``,
``device_counts_allowed``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.types import Choice
from .gemms import counts_stay_on_device
from .linear import QuantContext, compute_dtype, expert_names, grouped_fp4_linear, layer_keys, slot_arguments
from .ops import RecipeSlot, registered_recipe
from .recipe import Recipe


class RouterKind(Choice):
    SIGMOID = "sigmoid"
    """Independent per-expert gates (DeepSeek-V3), top-K weights renormalised."""
    SOFTMAX = "softmax"
    """A distribution over experts (Mixtral, Switch), top-K weights renormalised."""


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    n_experts: int = 8
    """E, routed experts."""
    top_k: int = 2
    """K, routed experts per token."""
    n_shared: int = 1
    """Shared experts (one dense SwiGLU of n_shared * expert_hidden), 0 for none."""
    expert_hidden: int = 128
    """F, each expert's SwiGLU hidden size (a multiple of 32 for FP4 blocks)."""
    router: RouterKind = RouterKind.SIGMOID
    bias_rate: float = 1e-3
    """Step of the balancing bias per update (0 disables auxiliary-loss-free balancing)."""
    aux_coef: float = 0.0
    """Weight of the Switch-style load-balancing loss (0: none)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "router", RouterKind.parse(self.router))
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.expert_hidden % 32 or self.expert_hidden <= 0:
            raise ValueError(f"expert_hidden must be a positive multiple of 32, got {self.expert_hidden}")


class GroupedExperts(RecipeSlot, nn.Module):
    """E SwiGLU experts: w_gate_EFD, w_up_EFD, w_down_EDF; x sorted by expert, counts per expert."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w_down = nn.Parameter(torch.empty(n_experts, dim, hidden))
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, std=0.02)
        self.recipe: Recipe | None = None
        self.name, self.context = "experts", QuantContext()

    def use_recipe(self, recipe: Recipe, name: str, context: QuantContext) -> None:
        """Run the expert GEMMs under ``recipe`` (called by nn.swap.quantize_model)."""
        self.recipe, self.name, self.context = recipe, name, context
        n_experts = self.w_gate.shape[0]
        self.keys = {label: layer_keys(expert_names(name, n_experts, label)) for label in ("gate", "up", "down")}

    grouped_mm = True
    """Use torch._grouped_mm where it runs (False: the per-expert loop, e.g. to compare)."""

    counts_kept = True
    """FP4 experts take the routing's counts as a device tensor where the recipe allows it
    (nn.gemms.counts_stay_on_device) and the step's seeds live on the device (a SeedTable: a CUDA
    training run's, train.run.seeds_on_device, or a graphed step's); False, or
    FP4LAB_DEVICE_COUNTS=0 in the environment: read on the host, the same bits (a fallback to
    compare with, not a recipe)."""

    def _on_grouped_mm(self, device: torch.device, dtype: torch.dtype) -> bool:
        return self.recipe is None and self.grouped_mm and grouped_mm_runs(device, dtype, *self.w_down.shape[1:])

    def _fp4_counts_kept(self, device: torch.device, dtype: torch.dtype) -> bool:
        # only where the step's seeds live on the device (a SeedTable: the trainer's on CUDA,
        # eager, compiled or graphed; without one, as in a bare forward, the counts are read on
        # the host, where the launches are sized to them: the same bits), and decided for the run,
        # both sides of any late switch: a rule read at the step's progress would be a guard on it
        # under torch.compile, a recompile at the switch
        # (a BF16-forward evaluation runs every GEMM in BF16 and is never graphed: host counts)
        if (self.recipe is None or not self.counts_kept or self.context.seeds is None or self.context.collect
                or self.context.forward_bf16):
            return False
        # what the rule reads from the environment, read here: a compiled graph guards on it, so a
        # change of a variable set when it was traced recompiles (the constant below carries no
        # guard of its own; the decision is meant for the whole run anyway)
        environment = (device_counts_allowed(), os.environ.get("FP4LAB_BACKEND", "auto"),
                       os.environ.get("TRITON_INTERPRET", ""))
        return _steps_keep_counts_traced(self.recipe_id, device, *self.w_down.shape[1:], dtype,
                                         *environment)

    def counts_on_device(self) -> bool:
        """Whether every training step (under bf16 autocast, compiled or not) keeps the routing's
        counts on the device, as a CUDA graph needs: BF16 experts on torch._grouped_mm, FP4
        experts whose recipe, before and after any late switch, quantizes each GEMM's activations
        for all experts at once or leaves the GEMM BF16 there. The loop, and the other FP4
        recipes, read them on the host."""
        on = self.grouped_mm if self.recipe is None else self.counts_kept
        return on and steps_keep_counts(self.recipe, self.w_down.device, *self.w_down.shape[1:])

    def forward(self, x_sorted_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x_sorted_SD)
        if self._on_grouped_mm(x_sorted_SD.device, dtype):
            offsets_E = counts_E.cumsum(0).to(torch.int32)

            def mm(x: torch.Tensor, w_EOI: torch.Tensor) -> torch.Tensor:
                return torch._grouped_mm(x.to(dtype), w_EOI.to(dtype).transpose(-2, -1), offs=offsets_E)
            return mm(F.silu(mm(x_sorted_SD, self.w_gate)) * mm(x_sorted_SD, self.w_up), self.w_down)
        if self.recipe is not None:
            name, recipe = slot_arguments(self)
            counts = counts_E if self._fp4_counts_kept(x_sorted_SD.device, dtype) else counts_E.tolist()

            def project(x: torch.Tensor, w: torch.Tensor, label: str) -> torch.Tensor:
                # expert e is the layer f"{self.name}.{e}.{label}" (its seeds and tensor scales)
                return grouped_fp4_linear(x, w, counts, recipe, name=name, context=self.context,
                                          label=label, keys=self.keys[label])
            h_SF = F.silu(project(x_sorted_SD, self.w_gate, "gate")) * project(x_sorted_SD, self.w_up, "up")
            return project(h_SF, self.w_down, "down")
        counts = counts_E.tolist()
        outs = []
        for e, x_nD in enumerate(x_sorted_SD.split(counts)):
            if x_nD.shape[0] == 0:
                continue
            h_nF = F.silu(F.linear(x_nD, self.w_gate[e])) * F.linear(x_nD, self.w_up[e])
            outs.append(F.linear(h_nF, self.w_down[e]))
        return torch.cat(outs) if outs else x_sorted_SD.new_zeros(x_sorted_SD.shape)


def steps_keep_counts(recipe: Recipe | None, device: torch.device, dim: int, hidden: int, *,
                      dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether every training step (``dtype``: the compute dtype, bf16 autocast by default) of
    experts [dim x hidden] under ``recipe`` (None: BF16 experts) keeps the routing's counts on
    ``device``, as a CUDA graph of the step needs: torch._grouped_mm for BF16 experts,
    nn.gemms.counts_stay_on_device for FP4 ones before and after any late switch (the trainer
    captures again after it), unless FP4LAB_DEVICE_COUNTS=0."""
    if recipe is None:
        return grouped_mm_runs(device, dtype, dim, hidden)
    return device_counts_allowed() and all(
        counts_stay_on_device(recipe.at_progress(p), device, dtype, dim, hidden) for p in (0.0, 1.0))


# the rule asks the machine and the environment (importlib's find_spec, the device's capability),
# which torch 2.11's dynamo will not trace (a graph break, an error under fullgraph): compiled, it
# runs once as the graph is traced and its answer is a constant; its arguments are constants there
# (a recipe by its registry index: 2.11 cannot pass it a frozen dataclass). ``environment`` is
# what the rule reads from os.environ, read by the traced caller so that the graph guards on it
@torch.compiler.assume_constant_result
def _steps_keep_counts_traced(recipe: int, device: torch.device, dim: int, hidden: int, dtype: torch.dtype,
                              *environment: object) -> bool:
    return steps_keep_counts(registered_recipe(recipe), device, dim, hidden, dtype=dtype)


def device_counts_allowed() -> bool:
    """False under FP4LAB_DEVICE_COUNTS=0: FP4 experts read the routing's counts on the host (the
    same bits; a fallback to compare with, not a recipe)."""
    return os.environ.get("FP4LAB_DEVICE_COUNTS", "1").lower() not in ("0", "false", "off", "no")


@torch.compiler.assume_constant_result  # (the device's capability: a constant where compiled, as above)
def grouped_mm_runs(device: torch.device, dtype: torch.dtype, dim: int, hidden: int) -> bool:
    """Whether BF16 experts of this width multiply on torch._grouped_mm (one call, the counts kept
    on the device) rather than the per-expert loop (the counts read on the host)."""
    # bf16 only: what the CUDA kernel takes, and all torch.compile's shape rule for it accepts;
    # rows 16-byte aligned (D and F multiples of 8), else the loop
    if not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16 or dim % 8 or hidden % 8:
        return False
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense feed-forward, and the shared experts."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, dim, cfg.expert_hidden)
        self.shared = SwiGLU(dim, cfg.n_shared * cfg.expert_hidden) if cfg.n_shared else None
        self.register_buffer("bias", torch.zeros(cfg.n_experts))  # persistent: resume needs it
        self.register_buffer("load", torch.zeros(cfg.n_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_TD -> (scores_TE float32, choice_TK int64, weight_TK float32, normalised per token)."""
        logits_TE = self.router(x_TD).float()
        scores_TE = logits_TE.sigmoid() if self.cfg.router is RouterKind.SIGMOID else logits_TE.softmax(-1)
        choice_TK = torch.topk(scores_TE + self.bias, self.cfg.top_k, dim=-1).indices
        weight_TK = scores_TE.gather(-1, choice_TK)
        return scores_TE, choice_TK, weight_TK / weight_TK.sum(-1, keepdim=True).clamp_min(1e-20)

    def sort_slots(self, choice_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (order_S: the S = T * K routed slots t * K + k sorted by expert (stable), counts_E)."""
        flat_S = choice_TK.reshape(-1)
        # counted into a fixed-size tensor (bincount's size depends on the data: a graph break)
        counts_E = flat_S.new_zeros(self.cfg.n_experts).index_add_(0, flat_S, torch.ones_like(flat_S))
        return torch.argsort(flat_S, stable=True), counts_E

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        scores_TE, choice_TK, weight_TK = self.route(x_TD)
        order_S, counts_E = self.sort_slots(choice_TK)
        # gathers by permutation only: their backward adds at distinct rows (deterministic)
        x_sorted_SD = x_TD.repeat_interleave(self.cfg.top_k, dim=0)[order_S]
        y_sorted_SD = self.experts(x_sorted_SD, counts_E)
        y_SD = y_sorted_SD[torch.argsort(order_S)]  # un-sort
        y_TD = (y_SD.view(-1, self.cfg.top_k, shape[-1]) * weight_TK[..., None].to(y_SD.dtype)).sum(1)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)

        if self.training:
            self.load += counts_E.to(self.load.dtype)
        if self.cfg.aux_coef:
            f_E = counts_E.to(torch.float32) / choice_TK.numel()  # fraction of the T * K routed slots
            p_E = (scores_TE / scores_TE.sum(-1, keepdim=True)).mean(0)
            self.aux_loss = self.cfg.aux_coef * self.cfg.n_experts * (f_E * p_E).sum()
        return y_TD.reshape(shape)

    @torch.no_grad()
    def update_bias(self) -> None:
        """bias += rate * sign(mean load - load); clears the load count (call after each step)."""
        if self.cfg.bias_rate and self.load.sum() > 0:
            self.bias += self.cfg.bias_rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()

    def routing_stats(self) -> dict[str, float | list[float]]:
        """Load fractions per expert of the counts since the last update, and max / mean load."""
        total = float(self.load.sum())
        frac = (self.load / total).tolist() if total else [0.0] * self.cfg.n_experts
        imbalance = float(self.load.max() / self.load.mean()) if total else float("nan")
        return {"load": frac, "max_over_mean": imbalance, "bias_abs_max": float(self.bias.abs().max())}
