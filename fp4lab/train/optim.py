"""Optimizers by lane, and learning-rate schedules.

Lanes (the MoE speedrun's ``expert_opt`` split):
    dense   2D hidden weights of the transformer blocks (attention and dense/shared MLP linears)
    expert  the routed experts' stacked [E, out, in] weights
    embed   embeddings, the LM head, the router, and every 1D parameter (gains, biases)
Each lane takes "adamw" or "muon"; embed is always AdamW (Muon is for hidden matrices).

Muon (Keller Jordan's): momentum, then the update orthogonalised by 5 Newton-Schulz iterations
with the quintic coefficients (3.4445, -4.7750, 2.0315) in bf16, scaled by sqrt(max(1, out/in)),
applied per matrix (per expert for stacked expert weights); decoupled weight decay as AdamW.
Under FSDP2 (train.parallel) parameters, gradients and momenta are DTensors sharded on dim 0:
AdamW and Muon's momentum are elementwise and run on the shards, but Newton-Schulz needs whole
matrices (``_orthogonalise``).

Schedules (a multiplier of the base learning rate at step s of n):
    cosine  linear warmup, then cosine from 1 down to ``final``
    wsd     linear warmup, constant, then a linear decay to ``final`` over the last ``decay`` fraction

Public: ``Muon``, ``lanes``, ``build_optimizers``, ``lr_multiplier``, ``OPTIMIZERS``, ``SCHEDULES``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .parallel import is_dtensor

LANES = ("dense", "expert", "embed")
OPTIMIZERS = ("adamw", "muon")
"""What the dense and expert lanes take."""
SCHEDULES = ("cosine", "wsd")
"""The learning-rate schedules lr_multiplier knows."""


def _newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """g: [..., m, n] -> an approximately orthogonal matrix with g's singular vectors."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return (x.mT if transposed else x).to(g.dtype)


def _orthogonalise(update: torch.Tensor) -> torch.Tensor:
    """_newton_schulz of every matrix of ``update`` ([..., m, n]), a tensor or a DTensor shard.
    Newton-Schulz mixes every row of a matrix with every other (x @ x^T), so a shard of rows
    orthogonalised alone is not a shard of the orthogonalised matrix: a DTensor sharded along
    the matrix gathers it whole (every rank runs the same iterations on the same matrix) and keeps
    its own rows of the result. A stack of experts sharded by expert holds whole matrices on
    every rank: those are orthogonalised where they are."""
    if not is_dtensor(update):
        return _newton_schulz(update)
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    if all(isinstance(p, Shard) and p.dim < update.dim() - 2 for p in update.placements):
        return DTensor.from_local(_newton_schulz(update.to_local()), update.device_mesh, update.placements,
                                  shape=update.shape, stride=update.stride())
    return distribute_tensor(_newton_schulz(update.full_tensor()), update.device_mesh, update.placements,
                             src_data_rank=None)


class Muon(torch.optim.Optimizer):
    """Momentum orthogonalised by Newton-Schulz, for 2D (or stacked [E, m, n]) weights."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() < 2:
                    raise ValueError(f"Muon takes matrices, got a parameter of shape {tuple(p.shape)}")
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = _orthogonalise(update) * math.sqrt(max(1.0, p.shape[-2] / p.shape[-1]))
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])


def lanes(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Split a model's parameters into the dense / expert / embed lanes."""
    out: dict[str, list[nn.Parameter]] = {lane: [] for lane in LANES}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if ".experts." in name and p.dim() == 3:
            out["expert"].append(p)
        elif p.dim() == 2 and name.startswith("blocks.") and "router" not in name:
            out["dense"].append(p)
        else:
            out["embed"].append(p)
    return out


def build_optimizers(model: nn.Module, *, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.95),
                     dense: str = "adamw", expert: str = "adamw", muon_lr: float = 0.02,
                     embed_lr: float | None = None) -> list[torch.optim.Optimizer]:
    """One optimizer per distinct kind: AdamW over the AdamW lanes, Muon over the Muon lanes.
    Each param group records its base ``initial_lr`` for the schedule."""
    groups = lanes(model)
    choice = {"dense": dense, "expert": expert, "embed": "adamw"}
    for lane, kind in choice.items():
        if kind not in OPTIMIZERS:
            raise ValueError(f"{lane} optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
    adam_groups, muon_groups = [], []
    for lane in LANES:
        if not groups[lane]:
            continue
        if choice[lane] == "muon":
            muon_groups.append({"params": groups[lane], "lr": muon_lr, "initial_lr": muon_lr, "lane": lane})
        else:
            base = embed_lr if lane == "embed" and embed_lr is not None else lr
            decay = 0.0 if lane == "embed" else weight_decay
            adam_groups.append({"params": groups[lane], "lr": base, "initial_lr": base, "weight_decay": decay,
                                "lane": lane})
    opts: list[torch.optim.Optimizer] = []
    if adam_groups:
        opts.append(torch.optim.AdamW(adam_groups, betas=betas, eps=1e-8))
    if muon_groups:
        opts.append(Muon(muon_groups, weight_decay=weight_decay))
    return opts


def lr_multiplier(step: int, total: int, *, warmup: int, schedule: str = "cosine", final: float = 0.1,
                  decay: float = 0.2) -> float:
    """The schedule's multiplier at ``step`` (0-based) of ``total`` steps."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        t = (step - warmup) / max(1, total - warmup)
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    if schedule == "wsd":
        start = total * (1 - decay)
        if step < start:
            return 1.0
        return 1 - (1 - final) * min(1.0, (step - start) / max(1.0, total - start))
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
